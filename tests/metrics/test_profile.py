"""`metrics.profile_steps` traces and the start-up parameter table.

Unit: `StepProfiler` traces exactly the chosen steps (one trace per run of consecutive steps), parsed back
with JAX's own XSpace reader (`jax.profiler.ProfileData`, the xplane.pb that TensorBoard's profile plugin
reads). End to end: `python -m rljax.main` with real vLLM, `--config.metrics.profile_steps=(3,4)`, a
jsonl source of conversations and `data.chat_template=true`: the trace of steps 3-4, `parameters.txt`,
and every rollout prompt rendered by the tokenizer's chat template (a reward that checks it).
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax_env import child_env

from rljax import config as C
from rljax.metrics.parameters import FILENAME, parameter_table, write_parameter_overview
from rljax.metrics.profile import profile_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
TESTS = pathlib.Path(__file__).resolve().parents[1] / "support"


def traced_steps(xplane_path) -> list[int]:
    """step_num of every StepTraceAnnotation("train") event in an .xplane.pb file."""
    data = jax.profiler.ProfileData.from_file(str(xplane_path))
    steps = []
    for plane in data.planes:
        for line in plane.lines:
            steps += [int(dict(e.stats)["step_num"]) for e in line.events if e.name == "train"]
    return sorted(steps)


def trace_runs(logdir) -> list[pathlib.Path]:
    return sorted(pathlib.Path(logdir, "plugins", "profile").iterdir())


# The traced steps run in a fresh interpreter, as in `rljax.main` (one profiler per process): in a test
# worker that had run ~400 other tests first, jax.profiler.StepTraceAnnotation's constructor once spun in
# native code for good (pytest-timeout's signal never reached Python; the suite hung at 99%).
TRACE_STEPS = """
import sys
import jax, jax.numpy as jnp
from rljax.metrics.profile import StepProfiler
f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
x = jnp.ones((64, 64))
profiler = StepProfiler(sys.argv[1], steps=(2, 3, 5))
for step in range(1, 7):
    with profiler.step(step):
        f(x + step).block_until_ready()
    assert profiler.active == (step == 2), step  # open across 2-3, closed after 3 and after 5
"""


def test_step_profiler_traces_only_the_chosen_steps(tmp_path):
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", TRACE_STEPS, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = trace_runs(tmp_path)
    assert len(runs) == 2, runs  # (2, 3) and (5,): one trace per run of consecutive steps
    xplanes = [next(run.glob("*.xplane.pb")) for run in runs]
    assert [traced_steps(p) for p in xplanes] == [[2, 3], [5]]
    assert all((run / "perfetto_trace.json.gz").stat().st_size > 0 for run in runs)


def test_profile_dir_per_process():
    assert profile_dir("/w", 0) == "/w/profile"
    assert profile_dir("/w", 3) == "/w/profile/process_3"


@pytest.mark.parametrize("steps", [(0,), (5,), (True,), ("3",)])
def test_profile_steps_must_be_step_numbers(steps):
    cfg = C.from_config_dict({"trainer": {"steps": 4}, "metrics": {"profile_steps": steps}})
    with pytest.raises(C.ConfigError, match="metrics.profile_steps"):
        C.validate(cfg)


def test_parameter_table_lists_shapes_sizes_and_shardings(tmp_path):
    mesh = jax.sharding.Mesh(jax.devices()[:8], ("fsdp",))
    spec = jax.sharding.PartitionSpec
    params = {
        "embed": {
            "embedding": jax.device_put(jnp.zeros((16, 8)), jax.NamedSharding(mesh, spec(None, "fsdp")))
        },
        "layers": {"q": {"kernel": jax.device_put(jnp.zeros((2, 8, 4)), jax.NamedSharding(mesh, spec()))}},
    }
    table = write_parameter_overview(params, str(tmp_path))
    assert (tmp_path / FILENAME).read_text() == table + "\n"
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "(16, 8)" in rows["embed/embedding"] and "128" in rows["embed/embedding"]
    assert "(None, 'fsdp')" in rows["embed/embedding"]
    assert "(2, 8, 4)" in rows["layers/q/kernel"] and "64" in rows["layers/q/kernel"]
    assert table.endswith("Total: 192 -- 768 bytes")
    assert parameter_table(params) == table


@pytest.fixture(scope="module")
def chat_run(arith_server, tmp_path_factory):
    """4 steps of the smoke job on conversations, tracing steps 3 and 4 (on the session's vLLM server)."""
    root = tmp_path_factory.mktemp("profile_run")
    data = root / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{a} + {b} ="}], "answer": str(a + b)}
        for a in range(10)
        for b in range(6)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    workdir = root / "w"
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}:{TESTS}")
    cmd = [
        sys.executable,
        "-m",
        "rljax.main",
        "--config=configs/grpo.py:smoke",
        f"--workdir={workdir}",
        "--config.trainer.steps=4",
        "--config.trainer.eval_every=0",
        "--config.metrics.profile_steps=(3,4)",
        "--config.data.source=jsonl",
        f"--config.data.path={data}",
        "--config.data.prompt_field=messages",
        "--config.data.eval_size=4",
        "--config.data.chat_template=true",
        "--config.data.system_prompt=You add numbers.",
        "--config.reward.functions=('chat_rewards:rendered_as_chat',)",
        *arith_server.main_args(),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return workdir, proc


@pytest.mark.vllm
@pytest.mark.slow
def test_main_writes_a_trace_of_the_chosen_steps(chat_run):
    workdir, _ = chat_run
    runs = trace_runs(workdir / "profile")
    assert len(runs) == 1, runs
    xplane = next(runs[0].glob("*.xplane.pb"))
    assert xplane.stat().st_size > 0
    assert traced_steps(xplane) == [3, 4]
    data = jax.profiler.ProfileData.from_file(str(xplane))
    events = {e.name for plane in data.planes for line in plane.lines for e in line.events}
    assert any("update" in name or "jit" in name for name in events), sorted(events)[:50]


@pytest.mark.vllm
@pytest.mark.slow
def test_main_writes_the_parameter_table_and_trains_on_rendered_conversations(chat_run):
    workdir, proc = chat_run
    from safetensors.numpy import load_file

    stored = load_file(str(REPO / "assets/tiny_arith/model.safetensors"))  # float32, lm_head tied
    count = sum(v.size for v in stored.values())
    table = (workdir / FILENAME).read_text()
    assert f"Total: {count:,} -- {4 * count:,} bytes" in table
    assert table.strip() in proc.stdout  # also in the run's log
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    assert rewards == [1.0] * 4  # every sampled prompt was the chat-template rendering
