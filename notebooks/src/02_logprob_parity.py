# %% [markdown]
# # 02 · Log-prob parity: the same weights in rljax, vLLM and transformers
#
# RL post-training compares two log-probs of every sampled token: the one the rollout engine (vLLM) reported
# when it sampled the token, and the one the trainer (rljax, JAX) computes for the update. The importance
# ratio between them is only meaningful if both sides hold **the same weights under the same names and
# layouts** (the weight sync) and mean **the same log-prob** (temperature, truncation).
#
# This notebook builds a tiny random Qwen2 model locally, starts the real vLLM CPU build on it, changes
# the weights in rljax, pushes them into the running server with rljax's verified weight sync, samples
# from vLLM, and scores the same tokens in rljax and in transformers (torch). Then it breaks the mapping
# on purpose to show what a wrong layout looks like, both in a separate copy and in the server, where the
# sync's canary refuses it. About a minute on a 2-core CPU.

# %% [install]

# %%
import atexit
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import matplotlib

if "ipykernel" not in sys.modules:  # run as a script: no frontend to draw into
    matplotlib.use("Agg")
import jax
import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers

from rljax import config as config_lib
from rljax import models, trainer
from rljax.loop.engine import make_canary_logprobs
from rljax.trajectory import Trajectory, build_loss_inputs
from rljax.models.tiny import build_tiny_checkpoint
from rljax.rollout import HostWeights, RolloutEngine, RolloutError, ServerOptions, VLLMServer
from rljax.sharding import make_mesh
from rljax.weight_sync import WeightSyncError, make_canary

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the outputs
WORKDIR = pathlib.Path(os.environ.get("RLJAX_NOTEBOOK_WORKDIR") or tempfile.mkdtemp(prefix="rljax_02_"))
print(
    "jax",
    jax.__version__,
    jax.default_backend(),
    "| transformers",
    transformers.__version__,
    "| workdir:",
    WORKDIR,
)

# %% [markdown]
# ## 1. A tiny Qwen2 checkpoint, built here (no hub), and a vLLM server on it
#
# `build_tiny_checkpoint` writes what a real local checkpoint has (config.json, model.safetensors, a
# trained byte-level BPE tokenizer): 2 layers, hidden 128, 4 query / 2 KV heads (head_dim 32, the smallest
# the CPU attention supports), tied embeddings. Its weights are random but far from uniform (std 0.1, norms
# and biases off their trivial init), so a wrong mapping shows up as a large log-prob difference.
#
# The server is started without waiting (`spawn`) so its ~25 s start-up overlaps the JAX and torch work
# below. It dies with this kernel, `atexit` stops it on a clean exit, and the last cell stops it. (The
# `os.fork()` RuntimeWarning comes from `subprocess` starting vLLM from a process that runs JAX threads;
# the child only sets its death signal and then execs vLLM.)

# %%
ckpt = build_tiny_checkpoint(WORKDIR / "tiny_qwen2", "qwen2", seed=0)
server = VLLMServer(
    ckpt,
    WORKDIR / "vllm",
    options=ServerOptions(gpu_memory_utilization=0.08, kvcache_space_gib=1, max_model_len=512),
).spawn()
atexit.register(server.stop)
print(sorted(p.name for p in ckpt.iterdir()))

# %% [markdown]
# ## 2. The same checkpoint in rljax and in transformers, then new weights in rljax
#
# `models.load_hf_checkpoint` maps every Hugging Face tensor into rljax's params (through the one name/layout
# table that checkpoint save and weight sync also use). We then move the weights, as an update would
# (Gaussian noise, std 0.05 on every tensor), so the server's checkpoint weights are stale until we push.
# transformers gets the new weights through the same mapping in reverse (`models.iter_hf_tensors`).

# %%
model_config, base_params = models.load_hf_checkpoint(ckpt)
tokenizer = models.load_tokenizer(ckpt)
leaves, treedef = jax.tree.flatten(base_params)
rng = np.random.default_rng(0)
params = jax.tree.unflatten(
    treedef, [x + 0.05 * rng.standard_normal(x.shape).astype(np.float32) for x in map(np.asarray, leaves)]
)
hf_state = dict(models.iter_hf_tensors(model_config, params))  # {hf_name: f32 array}: what the sync pushes
num_params = sum(v.size for v in hf_state.values())
print(f"{model_config.family}: {len(hf_state)} HF tensors, {num_params:,} parameters")

hf_model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def load_into_torch(state: dict) -> None:
    """HF state dict (numpy) -> the torch model; the tied lm_head follows the embeddings."""
    hf_model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()}, strict=False)
    hf_model.lm_head.weight = hf_model.model.embed_tokens.weight


def torch_logprobs(prompt_ids, completion_ids) -> np.ndarray:
    """f32[C]: transformers' log_softmax (temperature 1) of each completion token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([list(prompt_ids) + list(completion_ids)])).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logp[torch.arange(len(completion_ids)), torch.tensor(completion_ids)].float().numpy()


load_into_torch(hf_state)

# %% [markdown]
# ## 3. Push the new weights into the running server
#
# `engine.push_weights` stages the tensors in shared memory, pauses the server, loads them through vLLM's
# RL weight-update endpoints, resumes, and then runs the **canary**: fixed tokens scored by the server and
# by the engine's trainer side (the training path's log-prob function on the new params) must agree within
# `SyncOptions.canary_tolerance` (1e-4 here; the training loop's `rollout.weight_sync.canary_tolerance` is
# 1e-3), or the push raises `WeightSyncError` and generation is refused. The first push also opens the
# shared-memory transport and is the fresh server's first request (its warm-up): later pushes are faster.


# %%
cfg = config_lib.Config()  # float32 params and compute, the default log-prob implementation
mesh = make_mesh(data=1, fsdp=-1, tensor=1)
# the canary's trainer side is the training path itself (`trainer.make_logprob_fn` on these params)
rljax_canary = make_canary_logprobs(cfg, model_config, mesh, mesh.shape["data"] * mesh.shape["fsdp"])(params)


# the sync's fixed tokens (sized for the server's KV block): compile the JAX side while vLLM starts
canary = make_canary(model_config.vocab_size, block_size=server.options.block_size)
rljax_canary(canary.prompt_ids, canary.completion_ids)
t0 = time.perf_counter()
server.wait_healthy(300)
# HF-named tensors in, `rljax_canary` as the trainer side (the training loop's engine takes JAX params)
engine = RolloutEngine.connect([server.url], ckpt, servers=[server])
weights = HostWeights(rljax_canary)  # host tensors; the canary's trainer side is rljax's forward
atexit.register(engine.close)
print(f"vLLM up at {server.url} ({time.perf_counter() - t0:.1f} s more after the cells above)")

sync = engine.push_weights(weights.snapshot(models.iter_hf_tensors(model_config, params)), 1)
print(
    f"pushed {sync['weight_sync/bytes'] / 2**20:.2f} MiB in {sync['weight_sync/seconds'] * 1e3:.0f} ms "
    f"(server paused {sync['weight_sync/pause_seconds'] * 1e3:.0f} ms); canary max |diff| "
    f"{sync['weight_sync/canary_logprob_max_abs_diff']:.1e}; serving version {engine.version}"
)

# %% [markdown]
# ## 4. Sample from vLLM, score the same tokens in rljax and transformers
#
# vLLM returns the log-prob of every sampled token (rljax's servers run with processed log-probs: after
# temperature and truncation; at temperature 1 with no top-p/top-k that is the plain log-softmax).
# rljax scores them with the trainer's own batched function (`trainer.make_logprob_fn`, the one the update
# uses for old-policy log-probs), on rows built by the loop's `build_loss_inputs`.

# %%
prompts = ["What is 3 + 4? Answer:", "Compute 5 * 6 - 6 =", "The quick brown fox", '{"name": "calculator",']
prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
completions = engine.generate(prompt_ids, n=4, temperature=1.0, max_tokens=48, seed=0)
completions = [c for c in completions if c.token_ids]
print(f"{len(completions)} completions, {sum(len(c.token_ids) for c in completions)} tokens; e.g.")
for c in completions[::5][:3]:
    print(f"  {tokenizer.decode(c.prompt_ids)!r} -> {tokenizer.decode(c.token_ids)[:60]!r}")

logprob_fn = trainer.make_logprob_fn(cfg, model_config, mesh)  # the update's old-policy log-probs


def rljax_batch_logprobs(params, completions) -> list[np.ndarray]:
    """Per completion, f32[C]: the trainer's log-probs of its tokens (temperature 1)."""
    trajs = [Trajectory(c.prompt_ids, c.token_ids, c.logprobs, 0.0, 0, 0) for c in completions]
    batch = build_loss_inputs(trajs, np.zeros(len(trajs)), temperature=1.0)
    logp, _ = logprob_fn(params, trainer.shard_batch(batch, mesh))
    logp = np.asarray(logp)
    return [
        logp[i, len(c.prompt_ids) - 1 : len(c.prompt_ids) - 1 + len(c.token_ids)]
        for i, c in enumerate(completions)
    ]


lp_rljax = rljax_batch_logprobs(params, completions)
lp_vllm = [np.asarray(c.logprobs, np.float32) for c in completions]
lp_torch = [torch_logprobs(c.prompt_ids, c.token_ids) for c in completions]
flat = {k: np.concatenate(v) for k, v in {"rljax": lp_rljax, "vllm": lp_vllm, "torch": lp_torch}.items()}
diff_vllm = np.abs(flat["vllm"] - flat["rljax"])
diff_torch = np.abs(flat["torch"] - flat["rljax"])
print(f"log-probs of the sampled tokens range {flat['rljax'].min():.2f} .. {flat['rljax'].max():.2f} nats")
print(f"|vLLM - rljax|:         max {diff_vllm.max():.1e}  mean {diff_vllm.mean():.1e}")
print(f"|transformers - rljax|: max {diff_torch.max():.1e}  mean {diff_torch.mean():.1e}")

# %% [markdown]
# ### What a healthy mismatch looks like
#
# In float32 all three agree to ~1e-7..1e-5 nats per token: the same math in a different order (fused
# vocab-chunked softmax in rljax, vLLM's CPU kernels and repacked linear layers, torch's matmuls). It is
# noise: no trend over positions, largest on the least likely tokens (larger |log-prob|, same relative
# error). In bfloat16 the same plot sits around 1e-2: use float32 log-probs for the importance ratio.

# %%
pos = np.concatenate([np.arange(len(c.token_ids)) for c in completions])
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
axes[0].semilogy(pos, np.maximum(diff_vllm, 1e-9), ".", alpha=0.6, label="|vLLM - rljax|")
axes[0].semilogy(pos, np.maximum(diff_torch, 1e-9), "x", alpha=0.6, label="|transformers - rljax|")
axes[0].axhspan(1e-6, 1e-5, color="green", alpha=0.1, label="typical float32 level")
axes[0].set_xlabel("completion token position")
axes[0].set_ylabel("|log-prob difference| (nats)")
axes[0].set_title("same weights: healthy")
axes[0].legend(fontsize=8)
axes[1].semilogy(-flat["rljax"], np.maximum(diff_vllm, 1e-9), ".", alpha=0.6, label="|vLLM - rljax|")
axes[1].set_xlabel("-log-prob of the token (rljax)")
axes[1].set_title("error grows with |log-prob| (float32 rounding)")
axes[1].legend(fontsize=8)
plt.tight_layout()
plt.show()
assert diff_vllm.max() <= 1e-4 and diff_torch.max() <= 1e-4, (diff_vllm.max(), diff_torch.max())

# %% [markdown]
# ## 5. What a broken mapping looks like
#
# Three classic mistakes, each applied to a **separate copy** of the weights loaded into transformers (the
# server is not touched), scored on the same tokens against rljax:
#
# - `gate_proj`/`up_proj` swapped (same shapes, so nothing complains when loading);
# - `o_proj` pushed without its transpose (square, so again no shape error);
# - a stale tied `lm_head`: the output head keeps the old embeddings while the input embeddings are new
#   (what vLLM's CPU build does after an in-place reload unless the head is repacked; rljax's sync does).
#
# Each moves the differences up by five to six orders of magnitude: a mismatch metric
# (`logprob/trainer_vs_rollout_abs_diff_max` in every training step's metrics) of 1e-2 or more means the
# two sides do not hold the same model.


# %%
def swap_gate_up(state):
    out = dict(state)
    for name in state:
        if name.endswith("mlp.gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            out[name], out[up] = state[up], state[name]
    return out


def untransposed_o_proj(state):
    return {k: (v.T.copy() if k.endswith("o_proj.weight") else v) for k, v in state.items()}


base_embed = torch.from_numpy(
    np.array(dict(models.iter_hf_tensors(model_config, base_params))["model.embed_tokens.weight"])
)
broken = {}
for label, state in [
    ("gate/up swapped", swap_gate_up(hf_state)),
    ("o_proj untransposed", untransposed_o_proj(hf_state)),
]:
    load_into_torch(state)
    broken[label] = np.abs(
        np.concatenate([torch_logprobs(c.prompt_ids, c.token_ids) for c in completions]) - flat["rljax"]
    )
load_into_torch(hf_state)
hf_model.lm_head.weight = torch.nn.Parameter(base_embed.clone())  # untie: the head keeps the old weights
broken["stale tied lm_head"] = np.abs(
    np.concatenate([torch_logprobs(c.prompt_ids, c.token_ids) for c in completions]) - flat["rljax"]
)
load_into_torch(hf_state)  # back to the right weights (and re-tied)

bins = np.logspace(-9, 2, 45)
plt.figure(figsize=(8, 3.6))
plt.hist(np.maximum(diff_torch, 1e-9), bins=bins, alpha=0.7, label="correct mapping")
for label, d in broken.items():
    plt.hist(np.maximum(d, 1e-9), bins=bins, alpha=0.5, histtype="stepfilled", label=label)
plt.xscale("log")
plt.xlabel("|transformers - rljax| per token (nats)")
plt.ylabel("tokens")
plt.title(f"{diff_torch.size} sampled tokens: correct vs broken weight mappings")
plt.legend(fontsize=8)
plt.tight_layout()
plt.show()
for label, d in broken.items():
    ratio = np.median(d) / np.median(diff_torch)
    print(f"{label:>20}: max {d.max():.2e}  median {np.median(d):.2e}  ({ratio:.0e} x the healthy median)")
    assert d.max() > 100 * diff_torch.max(), label  # orders of magnitude, not noise

# %% [markdown]
# ## 6. A broken mapping pushed into the server: the canary refuses it
#
# The swapped `gate_proj`/`up_proj` pass every name and shape check, load, and the server resumes; but the
# canary's log-probs disagree with the trainer's, so the push raises `WeightSyncError` and the policy gate
# is marked broken: generation refuses to sample from weights the trainer does not hold. A full push of the
# right weights repairs it (the engine's recovery does this after a failure).

# %%
try:
    engine.push_weights(weights.snapshot(swap_gate_up(hf_state).items()), 2)
    raise AssertionError("the canary accepted a broken mapping")
except WeightSyncError as e:
    print("WeightSyncError:", str(e)[:300])
print("gate broken:", engine.gate.broken)
try:
    engine.generate([prompt_ids[0]], n=1, temperature=0.0, max_tokens=4)
    raise AssertionError("generation ran on weights the canary rejected")
except RolloutError as e:
    print("RolloutError:", e)

sync = engine.push_weights(weights.snapshot(models.iter_hf_tensors(model_config, params)), 3)
canary_diff = sync["weight_sync/canary_logprob_max_abs_diff"]
print(f"repaired: serving version {engine.version}, canary max |diff| {canary_diff:.1e}")
again = engine.generate(prompt_ids, n=4, temperature=1.0, max_tokens=48, seed=0)
again = [c for c in again if c.token_ids]
d = np.abs(
    np.concatenate([np.asarray(c.logprobs) for c in again])
    - np.concatenate(rljax_batch_logprobs(params, again))
)
print(f"after the repair |vLLM - rljax| max {d.max():.1e}")
assert engine.gate.broken is None and d.max() <= 1e-4

# %% [markdown]
# ## 7. Stop the server

# %%
engine.close()
print("vLLM server stopped:", not server.alive())
