"""rlmetrics never disables Ray's token authentication.

Ray's switches, as found in the installed Ray (2.60): the environment variables ``RAY_AUTH_MODE``
(``token`` / ``disabled``), ``RAY_AUTH_TOKEN`` and ``RAY_AUTH_TOKEN_PATH``, and the ``AUTH_MODE`` key
of ``ray.init(_system_config=...)``. A new local cluster of ``ray.init()`` turns token mode on by
default unless ``RAY_AUTH_MODE`` says otherwise.
"""

import json
import os
import re
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SRC = Path(__file__).resolve().parents[1] / "src" / "rlmetrics"

# Anything that could switch authentication off or replace the token: Ray's variables and config keys,
# the token loader, a _system_config or runtime_env env_vars, and writes to the environment unless they
# name one literal variable outside RAY_*.
FORBIDDEN = [
    re.compile(p)
    for p in (
        r"RAY_AUTH",
        r"(?i)auth_?mode",
        r"(?i)auth_?token",
        r"(?i)authentication",
        r"_system_config",
        r"env_vars",
    )
]
ENV_WRITE = re.compile(
    r"os\.(?:putenv|unsetenv|environ\.(?:setdefault|pop))\s*\((?P<key>[^,)]*)"
    r"|os\.environ\s*\[(?P<key2>[^]]*)\]\s*=(?!=)"
    r"|os\.environ\.(?:update|clear)\s*\(|del\s+os\.environ|os\.environ\s*[|]?="
)


def _env_write(line: str) -> bool:
    """Writes to the environment, except of one literal non-``RAY*`` variable."""
    for m in ENV_WRITE.finditer(line):
        key = re.fullmatch(r"\s*[\"']([^\"']*)[\"']\s*", m.group("key") or m.group("key2") or "")
        if key is None or key.group(1).upper().startswith("RAY"):
            return True
    return False


def violations(text: str) -> list[str]:
    """Lines of ``text`` that could touch Ray's authentication settings."""
    return [
        f"{i}: {line.strip()}"
        for i, line in enumerate(text.splitlines(), 1)
        if any(p.search(line) for p in FORBIDDEN) or _env_write(line)
    ]


def test_the_scan_catches_what_it_looks_for():
    bad = [
        'os.environ["RAY_AUTH_MODE"] = "disabled"',
        "ray.init(_system_config={'AUTH_MODE': 'disabled'})",
        "os.environ.setdefault('RAY_AUTH_TOKEN', 'x')",
        "ray.init(runtime_env={'env_vars': {'RAY_auth_mode': 'disabled'}})",
        "os.putenv(name, '1')",
        "del os.environ['RAY_AUTH_TOKEN_PATH']",
        "os.environ[key] = value",
        "os.environ.update(settings)",
        "os.environ['RAY_auth_mode'] = 'disabled'",
    ]
    for line in bad:
        assert violations(line), line
    assert not violations('if os.environ.get("DEBUG_METRICS", "0") == "1":')
    assert not violations('os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")')


def test_the_package_source_never_touches_ray_authentication():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 10
    found = {str(f.relative_to(SRC)): v for f in files if (v := violations(f.read_text(encoding="utf-8")))}
    assert not found, f"code that could weaken Ray's token authentication: {found}"


RUN = textwrap.dedent(
    """
    import json, os, time
    import grpc
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    import rlmetrics

    def auth_state(_self=None):
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
        return [is_token_auth_enabled(), os.environ.get("RAY_AUTH_MODE")]

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, name):
            self.client = rlmetrics.connect("ray", name=name, world_size=2, label="rank1")

        def step(self, values):
            self.client.submit_metric({"x/mean": values, "x/max": values})
            self.client.wait_submit()
            self.client.flush()
            return auth_state()

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    out = {"driver_before": auth_state()}
    root = rlmetrics.get_metric_worker(name="auth-test")
    rank1 = Rank.remote("auth-test")
    rank0 = rlmetrics.connect("ray", name="auth-test", world_size=2, label="rank0")
    rank0.submit_metric({"x/mean": [1.0, 2.0], "x/max": [1.0, 2.0]})
    rank0.wait_submit()
    out["rank_actor"] = ray.get(rank1.step.remote([3.0, 4.0, 5.0]))
    res = rank0.result(0, timeout=60)
    out["result"], out["complete"] = dict(res), res.meta.complete
    out["aggregator_actor"] = ray.get(root.__ray_call__.remote(auth_state))
    out["driver_after"] = auth_state()
    stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(
        grpc.insecure_channel(ray.get_runtime_context().gcs_address)
    )
    token = os.environ["RAY_AUTH_TOKEN"]
    for key, md in [("no_token", None), ("wrong_token", [("authorization", "Bearer x" + token)]),
                    ("token", [("authorization", "Bearer " + token)])]:
        try:
            stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), metadata=md, timeout=30)
            out[key] = "OK"
        except grpc.RpcError as exc:
            out[key] = exc.code().name
    ray.kill(rank1)
    ray.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


def test_an_aggregation_under_token_auth_works_and_leaves_it_on(tmp_path):
    """A real cluster started with ``RAY_AUTH_MODE=token``: rlmetrics aggregates exactly, token mode is
    still on in the driver, a rank actor and the aggregator actor afterwards, and the cluster still
    refuses a gRPC call without the token."""
    pytest.importorskip("ray")
    pytest.importorskip("grpc")
    pytest.importorskip(
        "ray._private.authentication.authentication_utils", reason="this Ray has no token authentication"
    )
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    script = tmp_path / "auth_run.py"
    script.write_text(RUN, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    on = [True, "token"]
    assert out["driver_before"] == on, out
    assert out["rank_actor"] == on and out["aggregator_actor"] == on and out["driver_after"] == on, out
    assert out["complete"], out
    assert out["result"] == {"x/mean": 3.0, "x/max": 5.0}
    assert (out["no_token"], out["wrong_token"], out["token"]) == ("UNAUTHENTICATED", "UNAUTHENTICATED", "OK")
