"""Prompts as conversations: `data.chat_template=true` renders them with the tokenizer's own chat template,
token for token what vLLM's chat endpoint builds (checked against a real vLLM server's
/v1/chat/completions `prompt_token_ids`); a tokenizer without a template is a config error."""

import json
import pathlib
import subprocess
import sys

import pytest
from jax_env import child_env

from rljax import config as C
from rljax.data import ChatRenderer, PlainRenderer, make_prompt_renderer, make_source, split_train_eval

# Qwen2.5-Instruct's chat template (tools branch included), so the default system prompt, a given system
# message, multi-turn history and the generation prompt follow what real Qwen checkpoints ship.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. ' }}
        {{- 'You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
            or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

CONVERSATIONS = [
    [{"role": "user", "content": "What is 7 + 5?"}],
    [
        {"role": "system", "content": "Answer with a number only."},
        {"role": "user", "content": "Compute 3 * 4."},
    ],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 4 * 9? Put it in \\boxed{}."},
    ],
]


def build_chat_checkpoint(path, template=QWEN25_TEMPLATE):
    """A tiny Qwen2 checkpoint whose tokenizer carries `template` (None: no chat template at all)."""
    import transformers

    from rljax.models.tiny import build_tiny_checkpoint

    build_tiny_checkpoint(path, "qwen2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = template
    for stale in path.glob("chat_template.*"):  # save_pretrained writes a template file only if one is set
        stale.unlink()
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture(scope="module")
def tokenizer(chat_dir):
    from rljax.models import load_tokenizer

    return load_tokenizer(chat_dir)


def test_string_prompt_becomes_a_user_turn_with_the_template_and_system_prompt(tokenizer):
    example = {"prompt": "7 + 5 =", "answer": "12"}
    renderer = make_prompt_renderer(
        tokenizer, template="Q: {prompt}", chat_template=True, system_prompt="Be brief."
    )
    assert isinstance(renderer, ChatRenderer)
    text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nQ: 7 + 5 =<|im_end|>\n<|im_start|>assistant\n"
    )
    assert renderer.text(example) == text
    assert renderer.ids(example) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert renderer.ids(example)[:1] == tokenizer.convert_tokens_to_ids(["<|im_start|>"])
    # Without a system prompt the template's own default system turn is used.
    bare = make_prompt_renderer(tokenizer, template="{prompt}", chat_template=True)
    assert bare.text(example).startswith(f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n")


def test_conversation_keeps_its_own_system_message_and_history(tokenizer):
    renderer = make_prompt_renderer(tokenizer, template="{prompt}", chat_template=True, system_prompt="X")
    assert renderer.messages({"prompt": CONVERSATIONS[1]}) == CONVERSATIONS[1]  # no second system turn
    assert renderer.messages({"prompt": CONVERSATIONS[0]})[0] == {"role": "system", "content": "X"}
    text = renderer.text({"prompt": CONVERSATIONS[2]})
    assert text.endswith(
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 4 * 9? Put it in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_plain_renderer_is_unchanged_and_refuses_conversations(tokenizer):
    renderer = make_prompt_renderer(tokenizer, template="{prompt} ->", chat_template=False)
    assert isinstance(renderer, PlainRenderer)
    assert renderer.text({"prompt": "1 + 1 ="}) == "1 + 1 = ->"
    assert (
        renderer.ids({"prompt": "1 + 1 ="}) == tokenizer("1 + 1 = ->", add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(ValueError, match="data.chat_template"):
        renderer.text({"prompt": CONVERSATIONS[0]})


def test_jsonl_source_yields_conversations_and_split_keeps_them_apart(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{i} + 1 ="}], "answer": str(i + 1)} for i in range(20)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    examples = make_source("jsonl", path=str(path), fields={"prompt": "messages"})
    assert examples[3]["prompt"] == [{"role": "user", "content": "3 + 1 ="}] and examples[3]["answer"] == "4"
    train, held_out = split_train_eval(examples, eval_size=5, seed=0)
    assert len(held_out) == 5 and len(train) == 15
    assert not {json.dumps(e["prompt"]) for e in train} & {json.dumps(e["prompt"]) for e in held_out}
    path.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "1"}))
    with pytest.raises(ValueError, match="record 0: a list prompt must be"):
        make_source("jsonl", path=str(path))


def test_config_checks(tmp_path, chat_dir):
    with pytest.raises(C.ConfigError, match="data.system_prompt"):
        C.validate(C.from_config_dict({"data": {"system_prompt": "Be brief."}}))
    with pytest.raises(C.ConfigError, match="data.chat_template: applies to single-turn"):
        C.validate(
            C.from_config_dict({"data": {"chat_template": True}, "rollout": {"env": "calculator_math"}})
        )
    ok = C.from_config_dict(
        {"model": {"path": str(chat_dir)}, "data": {"chat_template": True}, "mesh": {"fsdp": 1}}
    )
    C.validate_runtime(C.validate(ok), 1)
    bare = build_chat_checkpoint(tmp_path / "bare", template=None)
    cfg = C.from_config_dict(
        {"model": {"path": str(bare)}, "data": {"chat_template": True}, "mesh": {"fsdp": 1}}
    )
    with pytest.raises(C.ConfigError, match="data.chat_template: the tokenizer in .* has no chat template"):
        C.validate_runtime(C.validate(cfg), 1)


def test_cli_rejects_a_missing_template_before_any_server_starts(tmp_path):
    bare = build_chat_checkpoint(tmp_path / "bare", template=None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljax.main",
            "--config=configs/grpo.py",
            f"--workdir={tmp_path / 'w'}",
            f"--config.model.path={bare}",
            "--config.data.chat_template=true",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(JAX_PLATFORMS="cpu"),
        cwd=str(pathlib.Path(__file__).resolve().parents[2]),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rljax: error:")]
    assert len(errors) == 1 and "data.chat_template" in errors[0] and "no chat template" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "w" / "vllm").exists()  # failed during validation, before the server


@pytest.mark.vllm
@pytest.mark.slow
def test_tokens_equal_vllm_chat_endpoint(tmp_path, chat_dir, tokenizer):
    """The ids we send to /v1/completions == the prompt ids vLLM's /v1/chat/completions builds itself."""
    import requests

    from rljax.rollout import ServerOptions, VLLMServer
    from rljax.rollout.auth import bearer_headers

    options = ServerOptions(gpu_memory_utilization=0.08, kvcache_space_gib=1, max_model_len=512)
    renderer = make_prompt_renderer(tokenizer, template="Q: {prompt}", chat_template=True, system_prompt="S.")
    cases = [{"prompt": c} for c in CONVERSATIONS] + [{"prompt": "9 * 9 ="}]
    with VLLMServer(str(chat_dir), tmp_path / "server", options=options) as server:
        for example in cases:
            messages = renderer.messages(example)
            response = requests.post(
                f"{server.url}/v1/chat/completions",
                headers=bearer_headers(server.token),
                json={
                    "model": str(chat_dir),
                    "messages": messages,
                    "max_tokens": 1,
                    "return_token_ids": True,
                },
                timeout=60,
            )
            response.raise_for_status()
            assert response.json()["prompt_token_ids"] == renderer.ids(example), messages
