// CoreDNS for the real-node test tier (hack/realnode, tests/integration/realnode.py): the
// stock coremain with only the plugins the tier's Corefile uses, so the build compiles the
// kubernetes plugin and none of the cloud back-ends (azure, route53, clouddns, ...) that
// github.com/coredns/coredns/core/plugin pulls in.  This is CoreDNS's documented way to build
// with a chosen plugin set ("external golang source code"); the directive order stays the
// stock one (dnsserver.Directives).
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"

	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}
