"""One process of the dead-peer test (tests/loop/test_faults_loop.py): joins a 2-process job through
`rljax.runtime.initialize_jax` (RLJAX_* environment, as `rljax.launch` sets it), then runs the loop's
collectives (`broadcast_tree`, `barrier`) once per 0.2 s, printing `rljax-test: step k`, forever."""

import time

import numpy as np

from rljax import runtime


def main() -> None:
    runtime.initialize_jax()
    import jax

    from rljax.distributed import barrier, broadcast_tree

    like = {"x": np.zeros(3, np.float32)}
    for step in range(10**9):
        tree = broadcast_tree({"x": np.full(3, step, np.float32)} if jax.process_index() == 0 else None, like)
        assert float(tree["x"][0]) == step
        barrier(f"step {step}")
        print(f"rljax-test: step {step}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
