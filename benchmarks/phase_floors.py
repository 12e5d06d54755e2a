"""The floors bench_phases compares rljax's phases with, on the same requests and tokens: vLLM's offline
`LLM.generate` (`offline_generation`), a bare jitted `jax.value_and_grad` + optax AdamW step without padding
(`bare_update`), and rljax's own update outside the loop (`isolated_update`)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time

import numpy as np
from cpu_clock import CpuClock


def step_requests(cfg, steps: int) -> list[tuple[list[list[int]], int]]:
    """(prompt ids, base seed) per step: the prompts the loop drew (`PromptStream` order, sync mode)."""
    from rljax.loop.data_setup import PromptStream, load_examples
    from rljax.models import load_tokenizer

    tok = load_tokenizer(cfg.model.path)
    stream = PromptStream(load_examples(cfg.data)[0], seed=cfg.data.seed)
    need = cfg.rollout.batch_size // cfg.rollout.group_size
    out = []
    for step in range(steps):
        texts = [cfg.data.template.format(**ex) for ex in stream.next_examples(need)]
        ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
        out.append((ids, cfg.trainer.seed * 1_000_003 + step * 101))  # rollout_phase.select_groups
    return out


def offline_generation(cfg, requests) -> tuple[list[float], list[float], list, float]:
    """Seconds and CPU seconds (this process and the engine's) of `LLM.generate` per step, the last
    step's outputs, and the engine's CPU seconds in the second after its last generate, with the
    server's settings."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rljax.models import load_tokenizer
    from rljax.rollout import placement
    from rljax.rollout.server import ServerOptions, server_env

    vc, ro = cfg.rollout.vllm, cfg.rollout
    saved = dict(os.environ)
    place = placement.plan_placement(
        placement.allowed_cpus(), vc.placement, overlap=False, server_on_host=True
    )
    options = ServerOptions(
        kvcache_space_gib=vc.kvcache_space_gib, cpus=place.server_cpus, idle_spin_s=vc.idle_spin_s
    )
    os.environ.update(server_env(options))  # the loop's server's threads and cores
    # vLLM's IPC sockets and distributed-init file go to a private dir, removed below (not left in /tmp)
    tmp = tempfile.mkdtemp(prefix="rljax-offline-vllm-")
    os.environ.update(TMPDIR=tmp, VLLM_RPC_BASE_PATH=tmp)
    eos = int(load_tokenizer(cfg.model.path).eos_token_id)
    llm = LLM(
        cfg.model.path,
        dtype=cfg.model.param_dtype,
        max_model_len=vc.max_model_len,
        block_size=vc.block_size,
        gpu_memory_utilization=vc.gpu_memory_utilization,
        seed=cfg.trainer.seed,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
    )
    times, cpus, outputs, clock = [], [], None, CpuClock()
    try:
        for ids, seed in requests:
            params = [
                SamplingParams(
                    n=ro.group_size,
                    temperature=ro.temperature,
                    max_tokens=ro.max_tokens,
                    stop_token_ids=[eos],
                    logprobs=0,
                    seed=seed + i * ro.group_size,
                )
                for i in range(len(ids))
            ]
            clock.rescan()  # the engine core's processes
            (c0, k0), t0 = clock.read(), time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            c1, k1 = clock.read()
            cpus.append(c1 - c0 + k1 - k0)
        idle = idle_cpu_seconds(clock, 1.0)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(tmp, ignore_errors=True)
    sequences = [(list(o.prompt_token_ids), list(c.token_ids)) for o in outputs for c in o.outputs]
    return times, cpus, sequences, idle


def idle_cpu_seconds(clock: CpuClock, window_s: float) -> float:
    """CPU seconds the vLLM engine's processes (`clock`'s descendants) use in the `window_s` right after a
    generate call returns (an idle engine should use ~0; vLLM's worker alone busy-polls for 1 s unless
    told otherwise)."""
    before = clock.children_s()
    time.sleep(window_s)
    return clock.children_s() - before


def bare_update(model_path: str, sequences, repeats: int) -> tuple[list[float], list[float]]:
    """(seconds, CPU seconds) per bare value_and_grad + AdamW step on `sequences` [(prompt, completion)],
    no padding."""
    step = make_bare_step(model_path, sequences)
    runs = []
    for _ in range(repeats + 2):
        c0 = time.process_time()
        runs.append((timed(step), time.process_time() - c0))
    return [w for w, _ in runs[2:]], [c for _, c in runs[2:]]  # the first two calls compile


def alternate(runs: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each run in `runs` (name -> blocking fn), round-robin so load drifts hit every
    run alike; the first two rounds (compiles) dropped."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds + 2):
        for name, run in runs.items():
            t = timed(run)
            if r >= 2:
                times[name].append(t)
    return times


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_bare_step(model_path: str, sequences):
    """`fn()`: one bare value_and_grad + AdamW step on `sequences` (grouped by exact length), blocking."""
    import jax
    import jax.numpy as jnp
    import optax

    from rljax import models

    config, params = models.load_hf_checkpoint(model_path, dtype=jnp.float32)
    by_len: dict[int, list] = {}
    rng = np.random.default_rng(0)
    for p, c in sequences:
        by_len.setdefault(len(p) + len(c), []).append((p + c, len(p)))
    groups = []
    for length, items in sorted(by_len.items()):
        ids = np.asarray([s for s, _ in items], np.int32)
        mask = np.asarray([[float(t >= n - 1) for t in range(length - 1)] for _, n in items], np.float32)
        groups.append((ids, mask, rng.standard_normal(len(items)).astype(np.float32)))
    total = sum(float(m.sum()) for _, m, _ in groups)

    def loss_fn(params, groups):
        out = 0.0
        for ids, mask, adv in groups:
            hidden = models.hidden_states(config, params, ids[:, :-1])
            logits = hidden @ models.unembed_matrix(config, params).T
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
            out = out - jnp.sum(adv[:, None] * logp * mask)
        return out / total

    opt = optax.adamw(1e-5)

    @jax.jit
    def step(params, opt_state, groups):
        loss, grads = jax.value_and_grad(loss_fn)(params, groups)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    held = {"params": params, "opt_state": opt.init(params), "groups": jax.device_put(groups)}

    def run() -> None:
        held["params"], held["opt_state"], loss = step(held["params"], held["opt_state"], held["groups"])
        jax.block_until_ready(loss)

    return run


def isolated_update(cfg, sequences, repeats: int) -> tuple[list[float], float]:
    """Seconds per rljax update (prepare_batch + update) on `sequences`, outside the loop; pad fraction."""
    run, pad = make_isolated_update(cfg, sequences)
    return [timed(run) for _ in range(repeats + 2)][2:], pad


def make_isolated_update(cfg, sequences, advantages=None):
    """(`fn()`: one rljax update, prepare_batch included, blocking on its metrics; the pad fraction).
    Advantages f32[len(sequences)]: `advantages`, or standard normal draws."""
    import jax

    from rljax import trainer
    from rljax.config import mesh_shape
    from rljax.loop.setup import load_policy
    from rljax.sharding import make_mesh
    from rljax.trajectory import Trajectory, build_loss_inputs

    mesh = make_mesh(**mesh_shape(cfg.mesh, jax.device_count()))
    model_config, params, _ = load_policy(cfg, mesh)
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    update = trainer.make_update(cfg, model_config, mesh)
    trajs = [
        Trajectory(list(p), list(c), [-1.0] * len(c), 0.0, i // cfg.rollout.group_size, 0)
        for i, (p, c) in enumerate(sequences)
    ]
    adv = advantages if advantages is not None else np.random.default_rng(0).standard_normal(len(trajs))
    adv = np.asarray(adv, np.float32)
    batch = build_loss_inputs(
        trajs, adv, temperature=cfg.rollout.temperature, max_len=cfg.rollout.vllm.max_model_len
    )
    held = {"state": state}

    def run() -> None:
        sharded, _ = trainer.prepare_batch(cfg, batch, mesh)
        held["state"], _ = update(held["state"], sharded)  # metrics come back as host floats

    data_parallel = len(jax.devices())  # the bench's mesh: every device data-parallel
    return run, trainer.layout_batch(cfg, batch, data_parallel)[1].get("batch/pad_fraction", 0.0)
