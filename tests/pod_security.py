"""The checks of the Kubernetes Pod Security Standards' restricted profile, on a Pod spec, as Pod Security
admission makes them in a namespace labelled ``pod-security.kubernetes.io/enforce: restricted``
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, Linux Pods).

Neither kmock nor anything else in CI runs Pod Security admission, so the tests check the Pods heliotrope makes
(a job's Pod template, the deploy/ manifests) with this instead. A real cluster refuses what this reports; it
may refuse more (an admission webhook, a policy engine's own rules).
"""

from __future__ import annotations

from typing import Any

# Volume types the restricted profile allows (every other, hostPath first, is refused).
ALLOWED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                             "projected", "secret"})
# Sysctls the baseline profile (and so the restricted one) allows.
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes"})


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What of the restricted profile the Pod spec ``pod`` breaks, one line each (empty: it complies)."""
    out: list[str] = []
    pod_ctx = pod.get("securityContext") or {}
    containers = [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{key} is true")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"} - ALLOWED_VOLUMES
        if kinds:
            out.append(f"volume {volume.get('name')} is of type {', '.join(sorted(kinds))}")
    for sysctl in pod_ctx.get("sysctls", []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not a safe one")
    if pod_ctx.get("runAsUser") == 0:
        out.append("the Pod's runAsUser is 0")
    if (pod_ctx.get("seccompProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"the Pod's seccompProfile is {pod_ctx['seccompProfile'].get('type')}")
    for c in containers:
        ctx = c.get("securityContext") or {}
        name = f"container {c.get('name')}"
        if ctx.get("privileged"):
            out.append(f"{name} is privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name} does not set allowPrivilegeEscalation false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name} does not drop ALL capabilities")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name} adds capabilities other than NET_BIND_SERVICE")
        if ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is not True:
            out.append(f"{name} does not run as non-root (runAsNonRoot true, in the Pod or the container)")
        if ctx.get("runAsUser") == 0:
            out.append(f"{name}'s runAsUser is 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name} has no seccompProfile RuntimeDefault or Localhost (in the Pod or the container)")
        if ctx.get("procMount", "Default") != "Default":
            out.append(f"{name}'s procMount is {ctx['procMount']}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name} uses a hostPort")
    return out
