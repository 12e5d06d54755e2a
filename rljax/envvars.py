"""Which environment variables child processes may see.

One rule for every child rljax starts that could run someone else's code (vLLM servers with a model's
remote code and plugins, reward workers and their sandboxes): credential-like names never pass.
Standard library only, so spawned reward workers import it cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, GITHUB_PAT-style *_AUTH_*, ...
SECRET_ENV = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE", re.IGNORECASE)


def is_secret(name: str) -> bool:
    """Whether the variable `name` looks like a credential (`SECRET_ENV`)."""
    return SECRET_ENV.search(name) is not None


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less every credential-like name."""
    return {name: value for name, value in env.items() if not is_secret(name)}
