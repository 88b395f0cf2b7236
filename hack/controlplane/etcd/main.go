// Command etcd runs the etcd server for the AdaPtis integration-test control plane.
//
// go.etcd.io/etcd/server/v3 carries replace directives in its go.mod, so
// `go install go.etcd.io/etcd/server/v3@...` is refused; this tiny consumer module
// builds the same server by delegating to etcdmain.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
