"""A directory written by `save_hf_checkpoint` loads in real vLLM (CPU build) and generates our tokens."""

import json
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_env import child_env

from rljax import models
from rljax.models.tiny import build_tiny_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# vLLM spawns engine processes, so it runs in a script with a __main__ guard.
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        path, prompts, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
        llm = LLM(model=path, dtype="float32", gpu_memory_utilization=0.1, max_model_len=128,
                  enforce_eager=True, seed=0)
        sp = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        res = [{"tokens": list(o.outputs[0].token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
               for o in outs]
        print("RESULT" + json.dumps(res))
    """
)


def _greedy(config, params, prompt: list[int], steps: int):
    cache = models.init_cache(config, 1, len(prompt) + steps)
    logits, cache = models.prefill(config, params, cache, jnp.asarray([prompt], jnp.int32))
    last, tokens, logps = logits[:, -1], [], []
    for _ in range(steps):
        tok = int(jnp.argmax(last[0]))
        tokens.append(tok)
        logps.append(float(jax.nn.log_softmax(last[0])[tok]))
        last, cache = models.decode_step(config, params, cache, jnp.asarray([tok], jnp.int32))
    return tokens, logps


def test_vllm_loads_a_saved_checkpoint_and_matches_our_greedy_decode(tmp_path):
    src = build_tiny_checkpoint(tmp_path / "src", "qwen3", tie_word_embeddings=False)
    config, params = models.load_hf_checkpoint(src)
    out = models.save_hf_checkpoint(config, params, tmp_path / "saved", tokenizer_dir=src)
    prompts, steps = [[5, 17, 300, 42, 9], [100, 7, 7, 256]], 8
    with tempfile.TemporaryDirectory(prefix="vllm-") as tmp:  # vLLM's IPC sockets: short path, removed
        env = child_env(VLLM_CPU_KVCACHE_SPACE="1", JAX_PLATFORMS="cpu", TMPDIR=tmp)
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(out), json.dumps(prompts), str(steps)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    results = json.loads(lines[-1][len("RESULT") :])
    for prompt, res in zip(prompts, results, strict=True):
        tokens, logps = _greedy(config, params, prompt, steps)
        assert res["tokens"] == tokens
        # vLLM's CPU kernels (float32) sum in another order than XLA: rounding-level differences only.
        np.testing.assert_allclose(res["logprobs"], logps, atol=1e-4, rtol=0)
