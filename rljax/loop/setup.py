"""Builds everything one run needs, once, as a few typed parts: the Sampler, the Trainer, the Collector
(and async producer), the Evaluator and the run's IO. `build_run` returns them with the train state.

Each part is a frozen dataclass of handles, not logic: the loop in `rljax.loop.train` passes each phase
the part it needs, and the train state is passed and returned explicitly. Resuming restores the train
state, data position, policy version and async buffer from the newest good checkpoint, then re-pushes the
restored weights into the (new) rollout server before the first step; connected servers
(`rollout.vllm.urls`) get this run's weights before the first step even on a fresh start.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rljax import algos, models, trainer
from rljax.checkpoint import Checkpointer, abstract_like
from rljax.config import Config, mesh_shape, to_dict
from rljax.data import make_prompt_renderer
from rljax.distributed import is_leader
from rljax.loop import lora_setup
from rljax.loop.async_rollout import AsyncProducer
from rljax.loop.data_setup import PromptStream, load_examples
from rljax.loop.engine import make_engine, push_params
from rljax.loop.evaluation import NO_EVAL, Evaluator, make_evaluator
from rljax.loop.phases import PhaseTimer
from rljax.loop.rollout_phase import Collector, make_collector, select_groups
from rljax.metrics import MetricsLogger, StatusWriter
from rljax.models.hf import CheckpointFormatError
from rljax.rewards import RewardPool
from rljax.sampling import Engine, Sampler, SamplingOptions, Tokenizer, Weights
from rljax.sharding import make_mesh
from rljax.trainer.state import TrainState, model_decoder, resolve_model_config
from rljax.trajectory import Trajectory, build_loss_inputs
from rljax.types import LossInputs

# `update(state, sharded batch, ref_params or None) -> (state, metrics)`, jitted, built once.
UpdateFn = Callable[[TrainState, LossInputs, Any], tuple[TrainState, dict]]


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The update side: the jitted update, the batch layout/sharding, the advantage estimator, the
    reference params (None when algo.beta = 0), and the LossInputs structure non-leader processes
    receive each (broadcast) batch into."""

    model_config: models.ModelConfig
    mesh: Mesh
    update: UpdateFn
    prepare_batch: Callable[[LossInputs], tuple[LossInputs, dict]]  # -> (sharded batch, layout metrics)
    advantages: Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # (f32[B], i32[B], groups) -> f32[B]
    ref_params: Any  # a params pytree, or None
    batch_template: LossInputs


@dataclasses.dataclass(frozen=True)
class RunIO:
    """What the run writes: metrics, its status file, checkpoints, and the step's phase timings."""

    workdir: str
    logger: MetricsLogger
    status: StatusWriter
    checkpointer: Checkpointer
    timer: PhaseTimer
    config_dict: dict  # saved with every checkpoint


@dataclasses.dataclass(frozen=True)
class Run:
    """The parts of one run, built once by `build_run`. `producer` (async mode) and a working
    `evaluator` exist on the leader only (other processes get None and `NO_EVAL`)."""

    cfg: Config
    sampler: Sampler
    trainer: Trainer
    collector: Collector
    producer: AsyncProducer | None
    evaluator: Evaluator
    io: RunIO
    weights: Weights  # the trainer's side of each push: `snapshot(params)` (`loop.engine.push_params`)

    def close(self, phase: str = "done") -> None:
        """Stops everything; the status file ends with `phase` (done, failed, preempted)."""
        if self.producer is not None:
            self.producer.close()
        self.io.checkpointer.close()
        self.sampler.engine.close()
        self.weights.close()
        if self.sampler.rewards is not None:
            self.sampler.rewards.close()
        self.evaluator.close()
        self.io.logger.close()
        self.io.status.close(phase)


def make_advantages(cfg: Config) -> Callable:
    """Host-callable `fn(rewards f32[B], group_ids i32[B], num_groups) -> f32[B]` from the registry."""
    fn = algos.ADVANTAGES.get(cfg.algo.advantage)
    # algo.adv_<option> -> the estimator's keyword; each estimator takes the ones its signature declares.
    offered = {"std_scale": cfg.algo.adv_std_scale, "eps": cfg.algo.adv_eps}
    options = algos.advantage_options(fn, offered)
    jitted = jax.jit(lambda r, g, n: fn(rewards=r, group_ids=g, num_groups=n, **options), static_argnums=2)
    return lambda r, g, n: np.asarray(jitted(jnp.asarray(r), jnp.asarray(g), n))


def make_length_shaping(cfg: Config) -> Callable:
    """`fn(lengths list[int]) -> f32[B]` DAPO soft overlong penalty (zeros when algo.overlong_buffer = 0)."""
    if cfg.algo.overlong_buffer <= 0:
        return lambda lengths: np.zeros(len(lengths), np.float32)
    return lambda lengths: np.asarray(
        algos.overlong_penalty(
            jnp.asarray(lengths, jnp.int32),
            max_len=cfg.rollout.max_tokens,
            buffer=cfg.algo.overlong_buffer,
            penalty=cfg.algo.overlong_penalty,
        ),
        np.float32,
    )


def load_policy(cfg: Config, mesh: Mesh) -> tuple[models.ModelConfig, Any, Tokenizer]:
    """(model_config with the configured dtype policy, params in their shardings, tokenizer); the model
    config is the trainer's (`resolve_model_config`: dtypes, remat, attention, LoRA from `cfg.model`);
    with LoRA the params are the frozen base's."""
    # A LoRA run's base is frozen: it is held in the compute dtype (no float32 master copy).
    dtype = cfg.model.compute_dtype if cfg.model.lora_rank else cfg.model.param_dtype
    model_config, params = models.load_hf_checkpoint(
        cfg.model.path, dtype=jnp.dtype(dtype), mesh=mesh, decoder=model_decoder(cfg)
    )
    check_finite(params, cfg.model.path)
    return resolve_model_config(cfg, model_config), params, models.load_tokenizer(cfg.model.path)


def check_finite(params: Any, path: str) -> None:
    """Raises CheckpointFormatError naming the parameters that hold a NaN or an inf (one jitted
    reduction per parameter, where it lives; before any server is started with these weights)."""
    finite = jax.device_get(jax.jit(lambda p: jax.tree.map(lambda x: jnp.isfinite(x).all(), p))(params))
    bad = [jax.tree_util.keystr(k) for k, ok in jax.tree_util.tree_leaves_with_path(finite) if not ok]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise CheckpointFormatError(f"{path}: non-finite values (NaN or inf) in parameter {bad[0]}{more}")


def make_reward_pool(cfg: Config) -> RewardPool:
    return RewardPool(
        cfg.reward.specs(),
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        sandbox=cfg.reward.sandbox_settings(),
    )


def make_writers(cfg: Config, workdir: str, start_step: int) -> tuple[MetricsLogger, StatusWriter]:
    """Metrics logger (truncating lines past the resume point) and this process's status file."""
    process = jax.process_index()
    logger = MetricsLogger(
        workdir,
        process_index=process,
        tensorboard=cfg.metrics.tensorboard,
        console=cfg.metrics.console,
        wandb=_wandb(cfg),
        total_steps=cfg.trainer.steps,
        resume_step=start_step + 1 if start_step else 0,
    )
    return logger, StatusWriter(workdir, process)


def make_producer(collector: Collector, cfg: Config, start_step: int, extra: dict | None) -> AsyncProducer:
    """Async mode: a rollout producer running ahead of the trainer by at most trainer.max_staleness."""
    producer = AsyncProducer(
        lambda step: select_groups(collector, step),
        start_step=start_step,
        max_staleness=cfg.trainer.max_staleness,
        version=start_step,
        data_state=collector.prompts.state,
    )
    if extra is not None and "buffer" in extra:
        producer.restore(extra["buffer"])
    return producer.start()


def make_sampler(cfg: Config, tokenizer: Tokenizer, engine: Engine, rewards: RewardPool | None) -> Sampler:
    """The run's Sampler: `cfg.rollout`'s options (stop tokens default to the tokenizer's EOS)."""
    ro = cfg.rollout
    options = SamplingOptions(
        group_size=ro.group_size,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        max_tokens=ro.max_tokens,
        stop_token_ids=tuple(ro.stop_token_ids) or (int(tokenizer.eos_token_id),),
        max_sequence_length=ro.vllm.max_model_len,
    )
    renderer = make_prompt_renderer(
        tokenizer,
        template=cfg.data.template,
        chat_template=cfg.data.chat_template,
        system_prompt=cfg.data.system_prompt,
    )
    return Sampler(tokenizer, engine, renderer, rewards, make_length_shaping(cfg), options)


def make_trainer(cfg: Config, model_config: models.ModelConfig, mesh: Mesh, params: Any) -> Trainer:
    """The run's Trainer; the update factory is chosen by `algo.family` (`trainer.families`). With LoRA
    `params` (the frozen base) is bound to the update, which also takes its reference policy from it."""
    update = trainer.make_family_update(cfg, model_config, mesh)
    lora_run = bool(model_config.lora_rank)
    return Trainer(
        model_config=model_config,
        mesh=mesh,
        update=functools.partial(update, base=params) if lora_run else update,
        prepare_batch=lambda b: trainer.prepare_batch(cfg, b, mesh),
        advantages=make_advantages(cfg),
        ref_params=params if cfg.algo.needs_reference and not lora_run else None,
        batch_template=batch_template(cfg),
    )


def make_io(cfg: Config, workdir: str, checkpointer: Checkpointer, start_step: int) -> RunIO:
    logger, status = make_writers(cfg, workdir, start_step)
    timer = PhaseTimer(on_phase=lambda name: status.update(phase=name))
    config_dict = lora_setup.checkpoint_config(cfg, to_dict(cfg))
    return RunIO(workdir, logger, status, checkpointer, timer, config_dict)


def make_checkpointer(cfg: Config, workdir: str) -> Checkpointer:
    return Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep_last=cfg.checkpoint.keep_last,
        keep_every=cfg.checkpoint.keep_every,
        async_save=cfg.checkpoint.async_save,
    )


def build_run(
    cfg: Config, workdir: str, examples: tuple[list[dict], list[dict]] | None = None
) -> tuple[Run, TrainState, int]:
    """(parts, train state, start step): restores the newest good checkpoint in `workdir` if there is
    one. `examples` (train, eval): loaded from `cfg.data` when not given."""
    os.makedirs(workdir, exist_ok=True)
    sizes = mesh_shape(cfg.mesh, jax.device_count())
    mesh = make_mesh(**sizes)
    model_config, params, tokenizer = load_policy(cfg, mesh)
    initial = lora_setup.initial_params(cfg, model_config, params)
    state = trainer.init_train_state(cfg, model_config, initial, mesh)
    checkpointer = make_checkpointer(cfg, workdir)
    train_examples, eval_examples = load_examples(cfg.data) if examples is None else examples
    prompts = PromptStream(train_examples, seed=cfg.data.seed)
    start_step, extra, restored = 0, None, checkpointer.restore_latest(abstract_like(state))
    if restored is not None:
        start_step, state, extra = restored
        prompts.restore(extra["data"])
        print(f"rljax: resuming from checkpoint step {start_step} in {checkpointer.directory}", flush=True)
    data_parallel = sizes["data"] * sizes["fsdp"]
    engine, weights = make_engine(cfg, workdir, model_config, mesh, data_parallel=data_parallel, base=params)
    if restored is not None or cfg.rollout.vllm.urls:
        # A server we start holds the base weights; one we connect to holds whatever it was last sent
        # (e.g. a previous run's policy): either way serve exactly this run's weights from the first step.
        push_params(engine, weights, state.params, start_step)
    io = make_io(cfg, workdir, checkpointer, start_step)
    if restored is not None:
        lora_setup.check_base(checkpointer, start_step, io.config_dict)
    train_part = make_trainer(cfg, model_config, mesh, params)
    leader = is_leader()
    sampler = make_sampler(cfg, tokenizer, engine, make_reward_pool(cfg) if leader else None)
    collector = make_collector(cfg, sampler, prompts)
    evaluator = make_evaluator(cfg, sampler, eval_examples) if leader else NO_EVAL
    async_mode = leader and cfg.trainer.max_staleness > 0
    producer = make_producer(collector, cfg, start_step, extra) if async_mode else None
    run = Run(cfg, sampler, train_part, collector, producer, evaluator, io, weights)
    return run, state, start_step


def batch_template(cfg: Config) -> LossInputs:
    """A LossInputs with the structure (and sampler settings) of every batch this run trains on."""
    traj = Trajectory([1], [1], [-1.0], 0.0, 0, 0)
    ro = cfg.rollout
    return build_loss_inputs([traj], np.zeros(1), temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k)


def _wandb(cfg: Config) -> dict | None:
    if not cfg.metrics.wandb_project:
        return None
    return {"project": cfg.metrics.wandb_project, "mode": cfg.metrics.wandb_mode}
