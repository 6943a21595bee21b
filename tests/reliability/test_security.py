"""Security defaults: checkpoints and configs are read only through loaders that cannot run
code, and the embedded Ray keeps its dashboard off and requires Ray's token authentication."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "roles", "pipelines")

# In-memory round trips of objects this same process just serialized (never bytes read from
# a file or a peer): the local backend copies arguments "as Ray would", and the worker host
# checks that an exception survives pickling before sending it.
PICKLE_LOADS_ALLOWED = {"asyncrl/backends/local.py", "asyncrl/_host.py", "asyncrl/_wire.py"}


def _calls() -> list[tuple[str, int, str, ast.Call]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = (f.id if isinstance(f, ast.Name)
                            else f"{getattr(f.value, 'id', '?')}.{f.attr}" if isinstance(f, ast.Attribute) else "?")
                    out.append((rel, node.lineno, name, node))
    return out


def _kw(call: ast.Call, name: str) -> object:
    for k in call.keywords:
        if k.arg == name and isinstance(k.value, ast.Constant):
            return k.value.value
    return None


def test_no_code_executing_loader_on_any_config_or_data_path():
    bad = []
    for rel, line, name, call in _calls():
        where = f"{rel}:{line} {name}(...)"
        if name == "torch.load" and _kw(call, "weights_only") is not True:
            bad.append(where + " without weights_only=True")
        elif name in ("pickle.load", "cloudpickle.load", "cloudpickle.loads", "dill.load", "dill.loads",
                      "marshal.load", "marshal.loads", "shelve.open"):
            bad.append(where)
        elif name == "pickle.loads" and rel not in PICKLE_LOADS_ALLOWED:
            bad.append(where)
        elif name in ("eval", "exec", "compile"):
            bad.append(where)
        elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all"):
            bad.append(where + " (use yaml.safe_load)")
        elif name.endswith(".load") and name.startswith(("np.", "numpy.")) and _kw(call, "allow_pickle") is True:
            bad.append(where + " with allow_pickle=True")
        elif _kw(call, "trust_remote_code") is True:
            bad.append(where + " with trust_remote_code=True")
    assert not bad, "code-executing loaders:\n" + "\n".join(bad)


def test_checkpoint_loads_go_through_safetensors_or_weights_only():
    loads = [(rel, name) for rel, _, name, call in _calls() if name in ("torch.load", "load_file", "load_model")]
    assert ("pipelines/checkpoints/checkpointing.py", "torch.load") in loads  # the buffered batches
    assert ("roles/training/policy.py", "load_model") in loads  # weights: safetensors
    assert all(_kw(c, "weights_only") is True for _, _, n, c in _calls() if n == "torch.load")


def test_embedded_ray_has_no_dashboard_and_requires_token_authentication(ray_cluster):
    from ray._raylet import AuthenticationMode, get_authentication_mode

    info = ray._private.worker.global_worker.node.address_info
    assert not info["webui_url"]  # include_dashboard=False
    assert info["dashboard_agent_listen_port"] == -1
    ours = _listening_ports()
    assert int(info["gcs_address"].rsplit(":", 1)[1]) in ours  # the scan sees this Ray's own ports
    assert 8265 not in ours  # Ray's dashboard port
    assert get_authentication_mode() == AuthenticationMode.TOKEN  # every gRPC call needs the session token
    token = Path.home() / ".ray" / "auth_token"
    assert token.is_file() and oct(token.stat().st_mode & 0o077) in ("0o0", "0o44", "0o4", "0o40"), \
        "the token file must not be writable by others"


def test_embedded_ray_node_is_bound_to_loopback(ray_cluster):
    info = ray._private.worker.global_worker.node.address_info
    assert info["node_ip_address"] == "127.0.0.1"
    assert info["gcs_address"].startswith("127.0.0.1:")
    node = ray._private.worker._global_node
    ports = {int(info["gcs_address"].rsplit(":", 1)[1]), node.node_manager_port, node.runtime_env_agent_port}
    ports |= {p for p in (node.metrics_agent_port, node.dashboard_agent_listen_port) if p and p > 0}
    listening = _listening_addresses()
    for port in ports:
        assert listening.get(port), f"Ray port {port} is not listening"
        assert listening[port] <= _LOOPBACK, f"Ray port {port} listens on {listening[port]}, not only loopback"


_LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _listening_addresses() -> dict[int, set[str]]:
    """Listening TCP port -> the local addresses (hex, as /proc/net/tcp* writes them) it is bound to."""
    out: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] == "0A":  # LISTEN
                    addr, port = parts[1].rsplit(":", 1)
                    out.setdefault(int(port, 16), set()).add(addr.upper())
    return out


def _listening_ports() -> set[int]:
    """The TCP ports the processes of the Ray instance this test session started listen on
    (its GCS, raylet and every process they started: workers, agents), and no other
    process's: another Ray, or a dashboard, on a shared machine is not this one's. Read
    from /proc: each process's socket inodes, matched against the listening sockets."""
    node = ray._private.worker._global_node
    pids = {info.process.pid for infos in node.all_processes.values() for info in infos if info.process is not None}
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    grown = True
    while grown:  # every descendant of the Ray processes
        more = {pid for pid, ppid in parent.items() if ppid in pids} - pids
        pids |= more
        grown = bool(more)
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # the process ended, or is not ours to read
            pass
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:  # LISTEN, by one of this Ray's processes
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports
