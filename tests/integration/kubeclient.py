"""Clients of the integration-test cluster: the built kubectl and helm, run as subprocesses.

This module sits under ``controlplane.py``: :class:`ClusterClient` is the base of
:class:`controlplane.ControlPlane` (through :class:`fakenodes.FakeNodeClient`) and holds what
the tests call to talk to the cluster: ``kubectl``, ``helm``, ``get_json``, ``apply``,
``create_namespace``, ``wait_for_jsonpath`` and ``service_account_token``.  It runs the
binaries from ``bin_dir`` with ``KUBECONFIG`` pointing at the admin kubeconfig unless told
otherwise; a non-zero exit raises :class:`KubectlError` with stdout and stderr.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from processes import ControlPlaneError, wait_until

logger = logging.getLogger(__name__)


class KubectlError(subprocess.CalledProcessError):
    """A kubectl (or helm) call exited non-zero; the message includes its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


class ClusterClient:
    """Runs kubectl and helm from ``bin_dir`` against the cluster of the admin kubeconfig.

    Args:
        bin_dir: directory of the built binaries (``kubectl``, ``helm``...).
        work_dir: private directory; helm keeps its cache, config and data under ``helm/``.
        startup_timeout: seconds to wait for a new namespace's default ServiceAccount.
    """

    def __init__(self, *, bin_dir: Path, work_dir: Path, startup_timeout: float) -> None:
        self.bin_dir = bin_dir
        self.work_dir = work_dir
        self.startup_timeout = startup_timeout
        # Set once the cluster has started and its admin kubeconfig exists.
        self._kubeconfig: Path | None = None

    @property
    def kubeconfig(self) -> Path:
        """Path of the admin kubeconfig (user in group ``system:masters``)."""
        if self._kubeconfig is None:
            raise ControlPlaneError("the control plane has not been started")
        return self._kubeconfig

    def binary(self, name: str) -> Path:
        """Path of a built binary; raises :class:`ControlPlaneError` if it is missing."""
        path = self.bin_dir / name
        if not os.access(path, os.X_OK):
            raise ControlPlaneError(f"{path} is missing; run hack/build-control-plane.sh")
        return path

    def env(self, kubeconfig: Path | str | None = None) -> dict[str, str]:
        """Environment for clients: ``KUBECONFIG`` set and the bin dir first on ``PATH``."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | str | None = None,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster (admin kubeconfig unless given).

        Raises :class:`KubectlError` (with stdout and stderr) on a non-zero exit if ``check``.
        """
        return self._run_tool(
            "kubectl", args, input=input, check=check, kubeconfig=kubeconfig, timeout=timeout
        )

    def helm(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | str | None = None,
        timeout: float = 300.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built helm against this cluster with private HELM_* cache/config/data dirs."""
        return self._run_tool(
            "helm", args, input=input, check=check, kubeconfig=kubeconfig, timeout=timeout
        )

    def _run_tool(
        self,
        tool: str,
        args: Iterable[str],
        *,
        input: str | None,
        check: bool,
        kubeconfig: Path | str | None,
        timeout: float,
    ) -> subprocess.CompletedProcess[str]:
        command = [str(self.binary(tool)), *args]
        env = self.env(kubeconfig)
        if tool == "helm":
            helm_home = self.work_dir / "helm"
            for var, sub in (
                ("HELM_CACHE_HOME", "cache"),
                ("HELM_CONFIG_HOME", "config"),
                ("HELM_DATA_HOME", "data"),
            ):
                env[var] = str(helm_home / sub)
        logger.debug("running %s", " ".join(command))
        result = subprocess.run(  # our own binaries
            command,
            input=input,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, command, result.stdout, result.stderr)
        return result

    def get_json(self, *args: str, kubeconfig: Path | str | None = None) -> Any:
        """``kubectl get <args> -o json``, parsed."""
        result = self.kubectl("get", *args, "-o", "json", kubeconfig=kubeconfig)
        return json.loads(result.stdout)

    def apply(
        self,
        manifest: str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        namespace: str | None = None,
        kubeconfig: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl apply`` a YAML/JSON string, one object, or a list of objects."""
        if isinstance(manifest, str):
            text = manifest
        elif isinstance(manifest, Mapping):
            text = json.dumps(manifest)
        else:
            text = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifest)})
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=text, kubeconfig=kubeconfig)

    def create_namespace(self, name: str, *, wait_for_default_service_account: bool = True) -> str:
        """Create a namespace and (by default) wait until its ``default`` ServiceAccount exists.

        Pods cannot be created in a namespace before that ServiceAccount exists.
        """
        self.kubectl("create", "namespace", name)
        if wait_for_default_service_account:
            self._wait_for_default_service_account(name)
        return name

    def _wait_for_default_service_account(self, namespace: str) -> None:
        wait_until(
            lambda: (
                self.kubectl(
                    "get", "serviceaccount", "default", "-n", namespace, check=False
                ).returncode
                == 0
            ),
            timeout=self.startup_timeout,
            what=f"the default ServiceAccount in namespace {namespace}",
        )

    def wait_for_jsonpath(
        self,
        resource: str,
        jsonpath: str,
        value: str,
        *,
        namespace: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        """Wait until ``{jsonpath}`` of ``resource`` (e.g. ``pod/x``) equals ``value``."""
        args = [
            "wait",
            resource,
            f"--for=jsonpath={{{jsonpath}}}={value}",
            f"--timeout={int(timeout)}s",
        ]
        if namespace:
            args += ["-n", namespace]
        self.kubectl(*args, timeout=timeout + 30)

    def service_account_token(
        self, namespace: str, name: str, *, duration_seconds: int = 7200
    ) -> str:
        """A bound token for ServiceAccount ``namespace/name`` (``kubectl create token``)."""
        result = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={duration_seconds}s"
        )
        return result.stdout.strip()
