"""Multi-turn tool use with the real CPU vLLM: token-in/token-out against a reference forward, and GRPO
through `python -m rljax.main --config.rollout.env=calculator_math`.

A random tiny model never writes a tool call, so the module serves one taught the calculator format by
supervised learning, committed as `tests/assets/tiny_calculator` (tests/support/tool_model.py builds it).
Everything after that is real: vLLM samples every model turn, the calculator runs, the loop trains.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import tool_model
from jax_env import child_env

from rljax.data import make_prompt_renderer
from rljax.envs import ENVS, generate_multi_turn_groups
from rljax.envs.math_env import TOOL_RESPONSE
from rljax.rewards import RewardPool
from rljax.sampling import Sampler, SamplingOptions
from rljax.trajectory import build_loss_inputs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from rljax.rollout import RolloutEngine, ServerOptions

    root = tmp_path_factory.mktemp("multiturn")
    path = str(tool_model.ASSET)
    options = ServerOptions(
        gpu_memory_utilization=0.08, kvcache_space_gib=1, max_model_len=512, startup_timeout_s=300.0
    )
    engine = RolloutEngine.launch(path, root / "vllm", server_options=options)
    try:
        yield SimpleNamespace(engine=engine, path=path)
    finally:
        engine.close()


def _sampler(served, tok, pool, group_size=4) -> Sampler:
    """A real Sampler over the served engine; `pool` grades the episodes' final answers."""
    options = SamplingOptions(
        group_size=group_size,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=16,
        stop_token_ids=(tok.eos_token_id,),
        max_sequence_length=512,
    )
    renderer = make_prompt_renderer(tok, template="{prompt}", chat_template=False)
    no_shaping = lambda lengths: np.zeros(len(lengths), np.float32)  # noqa: E731
    return Sampler(tok, served.engine, renderer, pool, no_shaping, options)


def test_token_in_token_out_with_real_vllm(served):
    import transformers
    from vllm_server import TorchReference

    tok = transformers.AutoTokenizer.from_pretrained(served.path)
    examples = [{"expr": f"{a} + {b}", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (2, 2), (4, 0))]
    with RewardPool([("math", 1.0, {})], num_workers=1) as pool:
        sampler = _sampler(served, tok, pool)
        groups, metrics = generate_multi_turn_groups(
            sampler, examples, seed=7, spec=ENVS.get("calculator_math")
        )
    assert metrics["env/tool_calls"] >= 8, metrics  # the tool path ran for real on most episodes
    ref = TorchReference(served.path)
    checked = 0
    for g, ex in zip(groups, examples, strict=True):
        response = tok(
            TOOL_RESPONSE.format(output=str(eval(ex["expr"]))),  # noqa: S307  (a + b from this test)
            add_special_tokens=False,
        )["input_ids"]
        for t in g.trajectories:
            ids, mask = list(t.completion_ids), np.asarray(t.completion_mask)
            inserted = [x for x, m in zip(ids, mask, strict=True) if m == 0]
            if not inserted:
                continue
            assert inserted == response  # the tool output, tokenized once, nothing else at mask 0
            first = int(np.argmin(mask))
            assert tok.decode(ids[:first], skip_special_tokens=False).endswith("</tool_call>")
            # vLLM's log-probs of every sampled token, conditioned on the history it was given, equal
            # the reference forward over the trained row: the sampler saw exactly the trained tokens.
            expected = ref.logprobs(list(t.prompt_ids), ids)
            np.testing.assert_allclose(np.asarray(t.logprobs)[mask == 1], expected[mask == 1], atol=2e-4)
            batch = build_loss_inputs([t], np.zeros(1), temperature=1.0)
            p = len(t.prompt_ids)
            np.testing.assert_array_equal(np.asarray(batch.loss_mask[0, p - 1 : p - 1 + len(ids)]), mask)
            assert float(np.asarray(batch.loss_mask).sum()) == mask.sum()
            checked += 1
    assert checked >= 8


def test_grpo_main_multi_turn_calculator(served, tmp_path):
    url = served.engine.urls[0]
    args = [
        "--config=configs/grpo.py:smoke",
        "--config.rollout.env=calculator_math",
        f"--config.model.path={served.path}",
        f"--config.rollout.vllm.urls=('{url}',)",
        f"--config.rollout.vllm.token_file={served.engine.servers[0].token_file}",
        "--config.trainer.eval_every=0",
        # the prompts the model was taught on (tool_model.TASK)
        "--config.data.source_options=(('num_examples', 400), ('max_value', 4), ('ops', ('+',)))",
        f"--workdir={tmp_path}",
    ]
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-m", "rljax.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if line.strip()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    keys = ("env/tool_calls", "env/tool_errors", "env/turns_mean", "reward/mean", "timing/rollout_s")
    print({r["step"]: {k: r.get(k) for k in keys} for r in steps})  # shown with pytest -s
    for r in steps:
        assert r["env/tool_calls"] > 0 and r["env/turns_mean"] > 1.0, r
        assert "env/tool_errors" in r and "env/tool_timeouts" in r
        assert all(math.isfinite(v) for k, v in r.items() if k.startswith("loss") and isinstance(v, float))
