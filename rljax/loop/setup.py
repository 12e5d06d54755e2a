"""Builds everything one run needs, once: model, trainer functions, rollout engine, rewards, data, writers.

`Run` holds handles, not logic: the phases in `rljax.loop.train` and `rljax.loop.rollout_phase` use them.
Resuming restores the train state, data position, policy version and async buffer from the newest good
checkpoint, then re-pushes the restored weights into the (new) rollout server before the first step;
connected servers (`rollout.vllm.urls`) get this run's weights before the first step even on a fresh start.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax import algos, models, trainer
from rljax.checkpoint import Checkpointer, abstract_like
from rljax.config import Config, mesh_shape, to_dict
from rljax.data import make_prompt_renderer
from rljax.loop.async_rollout import AsyncProducer
from rljax.loop.data_setup import PromptStream, load_examples
from rljax.loop.distributed import is_leader, to_host
from rljax.loop.engine import make_engine
from rljax.loop.evaluation import make_evaluator
from rljax.loop.phases import PhaseTimer
from rljax.loop.rollout_phase import select_groups
from rljax.metrics import MetricsLogger, StatusWriter, device_memory_gb, host_memory_gb
from rljax.rewards import RewardPool
from rljax.sharding import make_mesh
from rljax.trainer.state import model_decoder, resolve_model_config
from rljax.trajectory import Trajectory, build_loss_inputs


@dataclasses.dataclass
class Run:
    cfg: Config
    workdir: str
    model_config: Any
    tokenizer: Any
    mesh: Any
    state: Any
    ref_params: Any
    update: Callable
    prepare_batch: Callable  # LossInputs -> (sharded batch, layout metrics): packed when configured
    advantages: Callable
    length_shaping: Callable
    engine: Any
    rewards: Any
    prompts: Any
    evaluate: Callable
    logger: Any
    status: Any
    checkpointer: Checkpointer
    timer: PhaseTimer
    config_dict: dict
    start_step: int
    stop_token_ids: tuple
    max_sequence_length: int
    renderer: Any  # rljax.data.make_prompt_renderer: example -> prompt text / token ids
    producer: Any = None
    batch_template: Any = None  # the LossInputs structure non-leader processes receive the batch into

    def encode_prompt(self, example: dict) -> list[int]:
        return self.renderer.ids(example)

    def prompt_text(self, example: dict) -> str:
        return self.renderer.text(example)

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def sync_weights(self, version: int) -> dict:
        return self.engine.push_weights(self.state.params, version)

    def checkpoint_extra(self) -> dict:
        """data position, policy version, and (async) the buffered batches, consistent with each other."""
        extra = {"policy_version": int(to_host(self.state.step)), "seed": self.cfg.trainer.seed}
        if self.producer is None:
            return extra | {"data": self.prompts.state()}
        snapshot = self.producer.snapshot()
        return extra | {"data": snapshot["data"], "buffer": snapshot}

    def system_metrics(self) -> dict:
        out = {"memory/host_rss_gb": host_memory_gb()}
        peak = device_memory_gb()
        if peak is not None:
            out["memory/device_peak_gb"] = peak
        return out

    def close(self, phase: str = "done") -> None:
        """Stops everything; the status file ends with `phase` (done, failed, preempted)."""
        closers = (
            getattr(self.producer, "close", None),
            self.checkpointer.close,
            self.engine.close,
            getattr(self.rewards, "close", None),
            getattr(self.evaluate, "close", None),
            self.logger.close,
        )
        for closer in closers:
            if closer is not None:
                closer()
        self.status.close(phase)


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


def load_policy(cfg: Config, mesh) -> tuple[Any, Any, Any]:
    """(model_config with the configured dtype policy, params in their shardings, tokenizer); the model
    config is the trainer's (`resolve_model_config`: dtypes, remat, attention from `cfg.model`)."""
    model_config, params = models.load_hf_checkpoint(
        cfg.model.path, dtype=jnp.dtype(cfg.model.param_dtype), mesh=mesh, decoder=model_decoder(cfg)
    )
    return resolve_model_config(cfg, model_config), params, models.load_tokenizer(cfg.model.path)


def make_reward_pool(cfg: Config) -> RewardPool:
    specs = [
        (name, weight, {}) for name, weight in zip(cfg.reward.functions, cfg.reward.weights, strict=True)
    ]
    return RewardPool(
        specs,
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


def attach_producer(run: Run, extra: dict | None) -> None:
    """Async mode: a rollout producer running ahead of the trainer by at most trainer.max_staleness."""
    run.producer = AsyncProducer(
        lambda step: select_groups(run, step),
        start_step=run.start_step,
        max_staleness=run.cfg.trainer.max_staleness,
        version=run.start_step,
        data_state=run.prompts.state,
    )
    if extra is not None and "buffer" in extra:
        run.producer.restore(extra["buffer"])
    run.producer.start()


def build_run(cfg: Config, workdir: str, examples: tuple[list[dict], list[dict]] | None = None) -> Run:
    """Everything one run needs; restores the newest good checkpoint in `workdir` if there is one.
    `examples` (train, eval): loaded from `cfg.data` when not given."""
    os.makedirs(workdir, exist_ok=True)
    sizes = mesh_shape(cfg.mesh, jax.device_count())
    mesh = make_mesh(**sizes)
    model_config, params, tokenizer = load_policy(cfg, mesh)
    state = trainer.init_train_state(cfg, model_config, params, mesh)
    make_update_fn = trainer.make_ppo_update if cfg.algo.family == "ppo" else trainer.make_update
    checkpointer = Checkpointer(
        os.path.join(workdir, "checkpoints"),
        keep_last=cfg.checkpoint.keep_last,
        keep_every=cfg.checkpoint.keep_every,
        async_save=cfg.checkpoint.async_save,
    )
    train_examples, eval_examples = load_examples(cfg.data) if examples is None else examples
    prompts = PromptStream(train_examples, seed=cfg.data.seed)
    start_step, extra, restored = 0, None, checkpointer.restore_latest(abstract_like(state))
    if restored is not None:
        start_step, state, extra = restored
        prompts.restore(extra["data"])
        print(f"rljax: resuming from checkpoint step {start_step} in {checkpointer.directory}", flush=True)
    engine = make_engine(cfg, workdir, model_config, mesh, data_parallel=sizes["data"] * sizes["fsdp"])
    if restored is not None or cfg.rollout.vllm.urls:
        # A server we start holds the base weights; one we connect to holds whatever it was last sent
        # (e.g. a previous run's policy): either way serve exactly this run's weights from the first step.
        engine.push_weights(state.params, start_step)
    logger, status = make_writers(cfg, workdir, start_step)
    run = Run(
        cfg=cfg,
        workdir=workdir,
        model_config=model_config,
        tokenizer=tokenizer,
        mesh=mesh,
        state=state,
        ref_params=params if cfg.algo.beta > 0 else None,
        update=make_update_fn(cfg, model_config, mesh),
        prepare_batch=lambda b: trainer.prepare_batch(cfg, b, mesh),
        advantages=make_advantages(cfg),
        length_shaping=make_length_shaping(cfg),
        engine=engine,
        rewards=None,
        prompts=prompts,
        evaluate=lambda: {},
        logger=logger,
        status=status,
        checkpointer=checkpointer,
        timer=PhaseTimer(on_phase=lambda name: status.update(phase=name)),
        config_dict=to_dict(cfg),
        start_step=start_step,
        stop_token_ids=tuple(cfg.rollout.stop_token_ids) or (int(tokenizer.eos_token_id),),
        max_sequence_length=cfg.rollout.vllm.max_model_len,
        renderer=make_prompt_renderer(
            tokenizer,
            template=cfg.data.template,
            chat_template=cfg.data.chat_template,
            system_prompt=cfg.data.system_prompt,
        ),
    )
    run.batch_template = batch_template(cfg)
    if not is_leader():
        return run
    run.rewards = make_reward_pool(cfg)
    run.evaluate = make_evaluator(run, eval_examples)
    if cfg.trainer.max_staleness > 0:
        attach_producer(run, extra)
    return run


def batch_template(cfg: Config):
    """A LossInputs with the structure (and sampler settings) of every batch this run trains on."""
    traj = Trajectory([1], [1], [-1.0], 0.0, 0, 0)
    ro = cfg.rollout
    return build_loss_inputs([traj], np.zeros(1), temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k)


def _wandb(cfg: Config) -> dict | None:
    if not cfg.metrics.wandb_project:
        return None
    return {"project": cfg.metrics.wandb_project, "mode": cfg.metrics.wandb_mode}
