"""A slow checkpoint save, wired in from the tests (no production code reads a test setting).

`install(seconds, step)` makes every async save of a `rljax.checkpoint.Checkpointer` (or only the save of
`step`, when given) wait `seconds` after its data is written and before orbax renames the step into place,
so the step stays `<step>.orbax-checkpoint-tmp*` meanwhile (orbax's `post_finalization_callback` runs
between the two). It never changes what is written. In-process tests pass `monkeypatch`; a subprocess run
goes through this file as its entry script:

    python tests/support/slow_save.py SECONDS STEP --config=... --workdir=...   # STEP may be "any"

which installs the hook and then runs `rljax.main.run` with the remaining arguments.
"""

import sys
import time

import orbax.checkpoint as ocp

from rljax import checkpoint


def install(seconds: float, step: int | None = None, monkeypatch=None) -> None:
    """Patches `checkpoint.manager_options` and `Checkpointer.save` (through `monkeypatch` when given)."""
    saving: list[int | None] = [None]
    make_options, save = checkpoint.manager_options, checkpoint.Checkpointer.save

    def hold() -> None:
        if step is None or saving[0] == step:
            print(f"rljax: test hook: holding save of step {saving[0]} for {seconds} s", file=sys.stderr)
            time.sleep(seconds)

    def slow_options(**kwargs) -> ocp.CheckpointManagerOptions:
        options = make_options(**kwargs)
        if kwargs["async_save"]:
            options.async_options = ocp.AsyncOptions(post_finalization_callback=hold)
        return options

    def recording_save(self, step_, *args, **kwargs):
        self.wait()  # the hold reads the step in flight: the previous save must be done first
        saving[0] = step_
        return save(self, step_, *args, **kwargs)

    set_attr = monkeypatch.setattr if monkeypatch is not None else setattr
    set_attr(checkpoint, "manager_options", slow_options)
    set_attr(checkpoint.Checkpointer, "save", recording_save)


if __name__ == "__main__":
    seconds, only = float(sys.argv[1]), sys.argv[2]
    install(seconds, None if only == "any" else int(only))
    from rljax.main import run

    run([sys.argv[0], *sys.argv[3:]])
