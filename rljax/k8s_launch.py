"""Kubernetes launcher: one rljax job as core-kind manifests (indexed Job, headless Service, Secret), or
their `k8s-local` rehearsal on this machine.

    python -m rljax.launch --backend=k8s --render DIR --num-processes 4 [--gpus-per-pod 8] \
        [--image IMG] [--pvc CLAIM] [--node-selector K=V ...] [--rollout-servers R] [--name rljax] \
        [--port 8476] [--python python] -- --config=configs/grpo.py:smoke --workdir=/runs/run1
    kubectl apply -k DIR

`--local` runs the rendered trainer pods here instead (into a temporary DIR when `--render` is not
given; see `rljax.k8s_local`): the same files, the same environment, Kubernetes' part played locally.
What is rendered: `rljax.k8s_render`; docs/launch.md, "Kubernetes". Bad flags: one line
`rljax: error: <flag>: <what is valid>`, exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile

from rljax import process_plan
from rljax.config import ConfigError
from rljax.k8s_local import run_local
from rljax.k8s_render import K8sJob, render, workdir_of, write

__all__ = ["K8sJob", "main", "parse", "render", "run_local", "write"]

DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # RFC 1035: Service and pod host names
MAX_NAME = 40  # leaves room for "-rollout-<index>" within a 63-character host name
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
LABEL_KEY = re.compile(rf"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?{LABEL_NAME}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage + message: one line naming the flag instead
        flag, _, what = message.removeprefix("argument ").partition(": ")
        if message.startswith("unrecognized arguments"):
            flag, what = what, "unknown flag (see python -m rljax.launch --backend=k8s --help)"
        raise ConfigError(flag, what)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m rljax.launch --backend=k8s", description=__doc__.split("\n")[0])
    p.add_argument("--render", metavar="DIR", default="", help="write the manifests + kustomization here")
    p.add_argument("--local", action="store_true", help="run the rendered trainer pods on this machine")
    p.add_argument("--num-processes", type=int, default=1, help="JAX processes: trainer pods")
    p.add_argument("--devices-per-process", type=int, default=0, help="simulated CPU devices per pod")
    p.add_argument("--gpus-per-pod", type=int, default=0, help="nvidia.com/gpu of each pod (0: CPU)")
    p.add_argument("--image", default="rljax", help="container image (an overlay's `images:` can patch it)")
    p.add_argument("--pvc", default="rljax-runs", help="ReadWriteMany claim holding the workdir")
    p.add_argument("--node-selector", action="append", default=[], metavar="K=V", help="repeatable")
    p.add_argument("--rollout-servers", type=int, default=0, help="pods of rljax.rollout.serve")
    p.add_argument("--name", default="rljax", help="the Job's and Service's name")
    p.add_argument("--port", type=int, default=0, help="coordinator port (default 8476; --local: free)")
    p.add_argument("--python", default="", help="interpreter in the image (default python; --local: this)")
    return p


def _selector(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = tuple(tuple(item.split("=", 1)) for item in items)
    for item, pair in zip(items, pairs, strict=True):
        ok = len(pair) == 2 and LABEL_KEY.fullmatch(pair[0]) and re.fullmatch(f"({LABEL_NAME})?", pair[1])
        if not ok or len(pair[1]) > 63:
            raise ConfigError(
                "--node-selector", f"KEY=VALUE with a label key and a label value, got {item!r}"
            )
    return pairs


def parse(ours: list[str], args: list[str]) -> tuple[K8sJob, argparse.Namespace]:
    """The job the flags `ours` describe for the rljax.main `args`; ConfigError naming the bad flag."""
    o = _parser().parse_args(ours)
    if o.num_processes < 1:
        raise ConfigError("--num-processes", f"a number of trainer pods >= 1, got {o.num_processes}")
    for flag, value in (("--devices-per-process", o.devices_per_process), ("--gpus-per-pod", o.gpus_per_pod)):
        if value < 0:
            raise ConfigError(flag, f"a count >= 0, got {value}")
    if o.gpus_per_pod and o.devices_per_process:
        raise ConfigError("--devices-per-process", "simulated CPU devices: 0 with --gpus-per-pod")
    if o.rollout_servers < 0 or (o.local and o.rollout_servers):
        raise ConfigError("--rollout-servers", f">= 0, and 0 with --local, got {o.rollout_servers}")
    if o.local and o.gpus_per_pod:
        raise ConfigError("--gpus-per-pod", "0 with --local (the rehearsal runs the pods on CPU)")
    if not (DNS_LABEL.fullmatch(o.name) and len(o.name) <= MAX_NAME):
        raise ConfigError("--name", f"lowercase letters, digits, '-', at most {MAX_NAME}, got {o.name!r}")
    if not 0 <= o.port <= 65535:
        raise ConfigError("--port", f"a TCP port 1-65535, got {o.port}")
    if not o.image or not DNS_LABEL.fullmatch(o.pvc.lower()) or o.pvc != o.pvc.lower():
        flag = "--image" if not o.image else "--pvc"
        raise ConfigError(flag, "an image reference" if not o.image else f"a claim name, got {o.pvc!r}")
    if not os.path.isabs(workdir_of(args)):
        raise ConfigError(
            "--workdir", f"an absolute path after -- (the PVC's mount), got {workdir_of(args)!r}"
        )
    if not (o.render or o.local):
        raise ConfigError("--render", "a directory for the manifests (or --local to rehearse)")
    port = o.port or (process_plan.free_port() if o.local else 8476)
    python = o.python or (sys.executable if o.local else "python")
    job = K8sJob(
        o.name, o.num_processes, o.devices_per_process, o.gpus_per_pod, o.image, o.pvc,
        _selector(o.node_selector), o.rollout_servers, port, python,
    )  # fmt: skip
    return job, o


def main(argv: list[str], image_env: dict[str, str] | None = None) -> int:
    """`--backend=k8s` (render) and `k8s-local` (`--local`): argv is the flags, `--`, the rljax.main
    args. Every pod's environment comes from `rljax.process_plan`. Returns the exit code (2: bad flags or
    config)."""
    ours, args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    try:
        job, opts = parse(ours, args)
    except ConfigError as e:
        print(f"rljax: error: {e}", file=sys.stderr)
        return 2
    try:
        manifests = render(args, job)
    except ConfigError as e:
        print(f"rljax: error: config: {e}", file=sys.stderr)
        return 2
    directory = opts.render or tempfile.mkdtemp(prefix="rljax-k8s-")
    try:
        write(manifests, directory)
        if not opts.local:
            print(f"rljax: rendered {', '.join(manifests)} into {directory}; kubectl apply -k {directory}")
            return 0
        try:
            return run_local(directory, image_env=image_env)
        except ConfigError as e:
            print(f"rljax: error: {e}", file=sys.stderr)
            return 2
    finally:
        if not opts.render:
            shutil.rmtree(directory, ignore_errors=True)  # the temporary render holds the job's token
