"""deploy/k8s: the overlays render, every object passes the Kubernetes schemas, and the
containers' flags, probes, ports and grace periods agree with `sits serve` / `sits router`."""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from sits.cli.main import build_parser
from tests.deploy.kustomize_lite import render, render_lite

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("gpu", "cpu")
K8S_VERSION = "1.30.0"  # the oldest minor we promise (PodDisruptionBudget, HPA v2, ...)
DRAIN_TAIL_S = 7  # after --shutdown-timeout: 2 s to flush cut streams + 5 s to close
KEY_FLAGS = ("--api-key", "--admin-key", "--router-key")


@functools.cache
def _rendered(overlay: str) -> list[dict[str, Any]]:
    return render(K8S / "overlays" / overlay)


def _objects(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects (rendered once per session; a fresh copy per call)."""
    return copy.deepcopy(_rendered(overlay))


def _get(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def _subparser(command: str) -> argparse.ArgumentParser:
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return subparsers.choices[command]


def _sits_argv(container: dict[str, Any]) -> tuple[str, list[str]]:
    """(subcommand, its arguments) of a container of the sits image (ENTRYPOINT `sits serve`
    unless `command` says otherwise)."""
    command = container.get("command", ["sits", "serve"])
    assert command[0] == "sits", command
    return command[1], command[2:] + container.get("args", [])


def _parse(container: dict[str, Any]) -> argparse.Namespace:
    """The container's arguments parsed by sits' own parser; every flag spelled in full (no
    argparse abbreviation) and known to it."""
    subcommand, argv = _sits_argv(container)
    parser = _subparser(subcommand)
    for arg in argv:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            assert flag in parser._option_string_actions, f"sits {subcommand}: unknown {flag}"
    return build_parser().parse_args([subcommand, *argv])


def _deployments(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "Deployment"]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _prestop_sleep_s(container: dict[str, Any]) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lite_loader_renders_as_kubectl(overlay: str) -> None:
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    lite = sorted(render_lite(K8S / "overlays" / overlay), key=key)
    assert lite == sorted(render(K8S / "overlays" / overlay), key=key)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_pass_the_kubernetes_schemas(overlay: str) -> None:
    objects = _objects(overlay)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "Deployment",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "Service",
        "ServiceMonitor",
    ]
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in kubernetes-validate, checked by hand below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_schema_validation_rejects_a_broken_probe() -> None:
    deployment = copy.deepcopy(_get(_objects("cpu"), "Deployment", "sits-replica"))
    _container(deployment)["readinessProbe"]["periodSeconds"] = "five"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    _container(deployment)["readinessProbe"]["periodSeconds"] = 5
    _container(deployment)["readinessProbe"]["perodSeconds"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_flags_probes_and_ports_are_ones_sits_accepts(overlay: str) -> None:
    objects = _objects(overlay)
    for deployment in _deployments(objects):
        pod = deployment["spec"]["template"]["spec"]
        container = _container(deployment)
        args = _parse(container)
        _, argv = _sits_argv(container)
        for arg in argv:  # keys only from files: a value on the command line shows in `ps`
            assert arg.split("=", 1)[0] not in KEY_FLAGS, arg
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        secret_mounts = [
            m["mountPath"]
            for m in container["volumeMounts"]
            for v in pod["volumes"]
            if v["name"] == m["name"] and v.get("secret", {}).get("secretName") == "sits-keys"
        ]
        assert secret_mounts == ["/etc/sits/keys"], mounts
        for flag in ("api_key_file", "admin_key_file", "router_key_file"):
            path = getattr(args, flag, None)
            if path is not None:
                assert Path(path).parent == Path("/etc/sits/keys"), (flag, path)
        assert args.router_key_file == "/etc/sits/keys/router-key"
        assert args.host == "0.0.0.0"
        # the image's user (Dockerfile: USER 10001), not root
        security = pod["securityContext"]
        assert (security["runAsNonRoot"], security["runAsUser"]) == (True, 10001)
        assert [p["containerPort"] for p in container["ports"]] == [args.port]
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(name)
            if probe is None:
                continue
            handler = probe.get("httpGet") or probe["tcpSocket"]
            assert _port_number(container, handler["port"]) == args.port, (name, handler)
            if "httpGet" in probe:
                assert probe["httpGet"]["path"] == "/health", name


def test_replicas_register_with_the_router_and_drain_in_the_grace_period() -> None:
    for overlay in OVERLAYS:
        objects = _objects(overlay)
        replica = _get(objects, "Deployment", "sits-replica")
        container = _container(replica)
        args = _parse(container)
        assert args.command == "serve"
        pod = replica["spec"]["template"]["spec"]
        # the kubelet's grace period covers preStop, the drain and its flush + close
        drain_s = _prestop_sleep_s(container) + args.shutdown_timeout + DRAIN_TAIL_S
        assert args.shutdown_timeout == 20
        assert pod["terminationGracePeriodSeconds"] > drain_s
        # liveness never kills a draining pod (it answers 503 while it drains)
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain_s
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model load
        # registration goes to the Service that ignores the router's readiness
        registry = _get(objects, "Service", "sits-router-registry")
        assert (
            args.register_with
            == f"http://sits-router-registry:{registry['spec']['ports'][0]['port']}"
        )
        assert registry["spec"]["publishNotReadyAddresses"] is True
        assert args.advertise_url == f"http://$(POD_IP):{args.port}"
        (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        router = _get(objects, "Deployment", "sits-router")
        router_args = _parse(_container(router))
        assert router_args.command == "router"
        assert registry["spec"]["ports"][0]["port"] == router_args.port


def test_gpu_overlay_takes_one_gpu_and_a_model_the_cpu_one_the_demo() -> None:
    gpu = _container(_get(_objects("gpu"), "Deployment", "sits-replica"))
    cpu = _container(_get(_objects("cpu"), "Deployment", "sits-replica"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["image"] == "sits:gpu"
    assert _parse(gpu).model == "/models/model"
    assert "/models" in [m["mountPath"] for m in gpu["volumeMounts"]]
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert cpu["image"] == "sits:cpu"
    cpu_args = _parse(cpu)
    assert cpu_args.model is None and cpu_args.model_tag is None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_pdb_hpa_and_servicemonitor_select_the_right_pods(overlay: str) -> None:
    objects = _objects(overlay)
    pods = {d["metadata"]["name"]: d for d in _deployments(objects)}
    labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in pods.items()}
    for deployment in pods.values():
        assert _matches(deployment["spec"]["selector"], labels[deployment["metadata"]["name"]])
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    expected = {
        "sits-replica": "sits-replica",
        "sits-router": "sits-router",
        "sits-router-registry": "sits-router",
    }
    for name, service in services.items():
        selected = [
            d
            for d, lab in labels.items()
            if _matches({"matchLabels": service["spec"]["selector"]}, lab)
        ]
        assert selected == [expected[name]], name
        (port,) = service["spec"]["ports"]
        assert (
            _port_number(_container(pods[selected[0]]), port["targetPort"])
            == _parse(_container(pods[selected[0]])).port
        )
    pdb = _get(objects, "PodDisruptionBudget", "sits-replica")
    assert [d for d, lab in labels.items() if _matches(pdb["spec"]["selector"], lab)] == [
        "sits-replica"
    ]
    hpa = _get(objects, "HorizontalPodAutoscaler", "sits-replica")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "sits-replica",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "sits:num_requests_waiting"
    from sits.obs import server_metrics

    assert '"sits:num_requests_waiting"' in inspect.getsource(server_metrics)
    assert "replicas" not in pods["sits-replica"]["spec"]  # the HPA owns the count
    # ServiceMonitor (a CRD, no schema): its fields by hand
    monitor = _get(objects, "ServiceMonitor", "sits")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    scraped = sorted(
        name
        for name, s in services.items()
        if _matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    )
    assert scraped == ["sits-replica", "sits-router"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s"}
    for name in scraped:
        assert [p["name"] for p in services[name]["spec"]["ports"]] == ["http"]
