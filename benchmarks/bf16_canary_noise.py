"""Can a log-prob canary see a subtly wrong bf16 push? Real vLLM (bf16) against three trainer sides.

    python benchmarks/bf16_canary_noise.py [--model assets/tiny_arith] [--perturb 0.01] [--json OUT]

Serves `--model` in bfloat16 twice: as it is, and with one tensor (layer 0's MLP down projection) off by
`--perturb` of its standard deviation (Gaussian). For each server and two kinds of completion tokens (random,
as the canary's, and the float32 model's greedy continuation) it prints max and mean |server - trainer|
log-prob, with the trainer's side computed in float32 on the float32 masters, in float32 on the bf16-rounded
weights, and in bf16 compute (rljax's decoder, `compute_dtype=bfloat16`). The canary could be tight only if
the clean server's differences sat well below the perturbed server's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from rljax import models
from rljax.rollout import ServerOptions, VLLMServer
from rljax.rollout.auth import bearer_headers
from rljax.rollout.server import served_model_name
from rljax.weight_sync.canary import server_prompt_logprobs

OPTIONS = ServerOptions(
    dtype="bfloat16",
    gpu_memory_utilization=0.08,
    kvcache_space_gib=1,
    max_model_len=512,
    startup_timeout_s=300.0,
)


def perturbed_copy(src: Path, dst: Path, scale: float) -> str:
    """`src` copied to `dst` with its first MLP down projection off by `scale` of its std; its name."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    key = sorted(k for k in sd if "mlp.down_proj" in k)[0]
    noise = np.random.default_rng(0).standard_normal(sd[key].shape)
    sd[key] = (sd[key] + scale * sd[key].std() * noise).astype(sd[key].dtype)
    save_file(sd, str(dst / "model.safetensors"))
    return key


def trainer_sides(model: Path, prompt: list[int]) -> tuple[dict, list[int]]:
    """({name: fn(completion) -> f32[C]}, the float32 model's greedy continuation of `prompt`)."""
    cfg32, p32 = models.load_hf_checkpoint(model, dtype=jnp.float32)
    cfg_bf = dataclasses.replace(cfg32, param_dtype="bfloat16", compute_dtype="bfloat16")

    def logprobs(config, params, completion):
        logits = models.forward(config, params, jnp.asarray([prompt + completion])).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits[0, len(prompt) - 1 : -1], -1)
        return np.asarray(lp[np.arange(len(completion)), np.asarray(completion)])

    greedy: list[int] = []
    for _ in range(64):
        logits = models.forward(cfg32, p32, jnp.asarray([prompt + greedy]))
        greedy.append(int(jnp.argmax(logits[0, -1])))
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), p32)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    sides = {
        "f32": lambda c: logprobs(cfg32, p32, c),
        "f32 on bf16 weights": lambda c: logprobs(cfg32, rounded, c),
        "bf16 compute": lambda c: logprobs(cfg_bf, bf16, c),
    }
    return sides, greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="assets/tiny_arith")
    ap.add_argument("--perturb", type=float, default=0.01)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    model = Path(args.model)
    vocab = models.read_model_config(model).vocab_size
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, vocab, 72)]
    tokens = {"random": [int(t) for t in rng.integers(0, vocab, 64)]}
    sides, tokens["greedy"] = trainer_sides(model, prompt)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rljax-bf16-canary-") as tmp:
        key = perturbed_copy(model, Path(tmp, "perturbed"), args.perturb)
        for server_name, path in (("clean", model), (f"perturbed ({key})", Path(tmp, "perturbed"))):
            server = VLLMServer(str(path), Path(tmp, f"wd-{len(rows)}"), options=OPTIONS).start()
            try:
                headers = bearer_headers(server.token)
                name = served_model_name(server.url, headers=headers)
                for kind, completion in tokens.items():
                    served = server_prompt_logprobs(server.url, name, prompt, completion, 60, headers)
                    for side, fn in sides.items():
                        d = np.abs(served.astype(np.float64) - fn(completion))
                        row = dict(server=server_name, tokens=kind, trainer=side, max=d.max(), mean=d.mean())
                        rows.append(row)
                        print(f"{server_name:48s} {kind:6s} {side:20s} max {d.max():.4f} mean {d.mean():.4f}")
            finally:
                server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=float))


if __name__ == "__main__":
    main()
