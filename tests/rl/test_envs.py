"""Environments on token ids: single-turn math and code, multi-turn tool use with a real
sandboxed Python tool, driven by scripted policies (callables returning canned turns)."""

from __future__ import annotations

import json
import re
import uuid

import fsspec
import pytest

from posttrain.data.tokenizer import ByteTokenizer, load_tokenizer
from posttrain.rl.envs import SingleTurnEnv, Task, ToolCallError, ToolEnv, parse_tool_call, run_episode, run_episodes
from posttrain.rl.reward import RewardConfig, RewardFunction, default_reward_function
from posttrain.rl.verifiers import CodeTask, MathTask
from posttrain.sandbox import Sandbox

TOK = ByteTokenizer()
PRODUCT = Task(
    "mul", ({"role": "user", "content": "What is 123456789 * 987654321?"},), MathTask(str(123456789 * 987654321))
)
TOOL_CALL = "Let me compute it.\n<tool>python\nprint(123456789 * 987654321)\n</tool>"


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    with Sandbox(max_workers=2) as sb:
        yield sb


@pytest.fixture(scope="module")
def reward_fn(sandbox) -> RewardFunction:
    return default_reward_function(RewardConfig(invalid_tool_call_penalty=0.1), sandbox)


def turn(text: str, tok=TOK) -> list[int]:
    """A model turn as the sampler returns it: the text's tokens and the end-of-turn token."""
    return tok.encode(text) + [tok.eos_id]


def scripted(*turns, tok=TOK):
    """A policy that plays `turns` in order; a callable turn gets the decoded context."""
    it = iter(turns)

    def policy(context: list[int]) -> list[int]:
        t = next(it)
        return turn(t(tok.decode(context)) if callable(t) else t, tok)

    return policy


def last_output(context: str) -> str:
    """What the last tool run printed, as the model would read it from its context."""
    return re.findall(r"<output>\n(.*?)</output>", context, re.DOTALL)[-1].strip()


def runs(tokens, mask) -> list[list[int]]:
    """Maximal runs of tokens whose mask is True."""
    out, cur = [], []
    for t, m in zip(tokens, mask):
        if m:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


def test_tool_episode_end_to_end(sandbox, reward_fn):
    env = ToolEnv(TOK, reward_fn, sandbox, max_turns=3, max_turn_tokens=256)
    answer = lambda ctx: f"The tool says {last_output(ctx)}, so the answer is \\boxed{{{last_output(ctx)}}}."
    policy = scripted(TOOL_CALL, answer)
    traj = run_episode(env, PRODUCT, policy)
    assert traj.reward.score == 1.0 and traj.reward.parts["correct"] == 1.0
    assert traj.turns == 2 and traj.info["tool_calls"] == 1 and traj.info["invalid_tool_calls"] == 0
    final = f"The tool says {PRODUCT.target.answer}, so the answer is \\boxed{{{PRODUCT.target.answer}}}."
    assert runs(traj.tokens, traj.loss_mask) == [turn(TOOL_CALL), turn(final)]
    assert traj.num_generated == len(turn(TOOL_CALL)) + len(turn(final))
    # Every other token is prompt or environment output, exactly as the chat template lays it out.
    messages = [
        {"role": "system", "content": env.system_prompt},
        *PRODUCT.prompt,
        {"role": "assistant", "content": TOOL_CALL},
        {"role": "tool", "content": f"<output>\n{PRODUCT.target.answer}\n</output>"},
        {"role": "assistant", "content": final},
    ]
    ids, trainable = TOK.encode_chat(messages)
    assert traj.tokens == ids and traj.loss_mask == trainable
    assert traj.prompt_len == len(TOK.encode_chat(messages[:2], add_generation_prompt=True)[0])


def test_wrong_final_answer_gets_zero(sandbox, reward_fn):
    env = ToolEnv(TOK, reward_fn, sandbox, max_turns=3, max_turn_tokens=256)
    traj = run_episode(env, PRODUCT, scripted(TOOL_CALL, "The answer is \\boxed{42}."))
    assert traj.reward.score == 0.0 and traj.info["truncated"] is None


def test_step_api_and_observation_tokens(sandbox, reward_fn):
    env = ToolEnv(TOK, reward_fn, sandbox, max_turns=2, max_turn_tokens=128)
    prompt = env.reset(PRODUCT)
    assert (
        prompt
        == TOK.encode_chat(
            [{"role": "system", "content": env.system_prompt}, *PRODUCT.prompt], add_generation_prompt=True
        )[0]
    )
    obs, reward, done, info = env.step(turn("<tool>python\nprint('hi')\n</tool>"))
    assert not done and reward is None and info["tool_calls"] == 1
    assert TOK.decode(obs) == "<output>\nhi\n</output>" and obs[-1] == TOK.ROLES["assistant"]
    obs, reward, done, info = env.step(turn("\\boxed{1}"))
    assert done and obs == [] and reward.score == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step(turn("again"))


def test_turn_limit(sandbox, reward_fn):
    env = ToolEnv(TOK, reward_fn, sandbox, max_turns=2, max_turn_tokens=256)
    traj = run_episode(env, PRODUCT, scripted(TOOL_CALL, TOOL_CALL, TOOL_CALL))
    assert traj.turns == 2 and traj.info["truncated"] == "max_turns" and traj.info["tool_calls"] == 2
    assert traj.reward.parts["correct"] == 0.0
    assert TOK.decode(traj.tokens).count("<output>\n") == 1, "the call on the last turn is not run"


def test_per_turn_token_budget(sandbox, reward_fn):
    env = ToolEnv(TOK, reward_fn, sandbox, max_turns=3, max_turn_tokens=32)
    rambling = lambda context: TOK.encode("x" * 100)  # no end-of-turn token, over budget
    traj = run_episode(env, PRODUCT, rambling)
    assert traj.num_generated == 32 and traj.turns == 1 and traj.info["truncated"] == "turn_tokens"
    assert traj.reward.score == 0.0
    # A correct answer cut by the budget earns nothing either.
    cut = run_episode(
        ToolEnv(TOK, reward_fn, sandbox, max_turn_tokens=8), PRODUCT, scripted(f"\\boxed{{{PRODUCT.target.answer}}}")
    )
    assert cut.num_generated == 8 and cut.reward.score == 0.0
    with pytest.raises(ValueError, match="stop token at position 1"):
        env.reset(PRODUCT)
        env.step([TOK.encode("a")[0], TOK.eos_id, TOK.encode("b")[0], TOK.eos_id])


def test_invalid_and_failing_tool_calls_are_penalised(sandbox, reward_fn):
    env = ToolEnv(TOK, reward_fn, sandbox, max_turns=4, max_turn_tokens=256)
    traj = run_episode(
        env,
        PRODUCT,
        scripted(
            "<tool>python\nprint(1)",  # unclosed
            "<tool>python\nraise ValueError('boom')\n</tool>",  # runs, fails
            lambda ctx: f"\\boxed{{{PRODUCT.target.answer}}}" if "ValueError: boom" in ctx else "no traceback",
        ),
    )
    assert traj.info["tool_calls"] == 2 and traj.info["invalid_tool_calls"] == 2
    assert traj.reward.parts == {"correct": 1.0, "format": 0.0, "length": 0.0, "tool_calls": pytest.approx(-0.2)}
    text = TOK.decode(traj.tokens)
    assert "<output>\nerror: malformed tool call" in text and "[status: fail]" in text


def test_parse_tool_call():
    assert parse_tool_call("The answer is 4.") is None
    call = parse_tool_call("Check:\n<tool>python\nx = 1\nprint(x)\n</tool>\n")
    assert call.name == "python" and call.code == "x = 1\nprint(x)\n"
    for text, why in [
        ("<tool>python print(1)</tool>", "malformed"),
        ("<tool>python\n1\n</tool> done", "text after"),
        ("<tool>python\n1\n</tool><tool>python\n2\n</tool>", "2 tool calls"),
        ("<tool>bash\nls\n</tool>", "unknown tool 'bash'"),
    ]:
        with pytest.raises(ToolCallError, match=why):
            parse_tool_call(text)


def test_single_turn_math_and_code(sandbox, reward_fn):
    math_env = SingleTurnEnv(TOK, reward_fn, max_turn_tokens=64)
    task = Task("add", ({"role": "user", "content": "What is 2+3?"},), MathTask("5"))
    good = run_episode(math_env, task, scripted("2+3=5. The answer is \\boxed{5}."))
    assert (
        good.reward.score == 1.0
        and good.turns == 1
        and good.num_generated == len(turn("2+3=5. The answer is \\boxed{5}."))
    )
    assert run_episode(math_env, task, scripted("\\boxed{6}")).reward.score == 0.0
    code = Task(
        "sq",
        ({"role": "user", "content": "Write square(x)."},),
        CodeTask(test="assert square(3) == 9 and square(-2) == 4", functions=("square",)),
    )
    code_env = SingleTurnEnv(TOK, reward_fn, max_turn_tokens=128)
    assert run_episode(code_env, code, scripted("```python\ndef square(x):\n    return x * x\n```")).reward.score == 1.0
    assert run_episode(code_env, code, scripted("```python\ndef square(x):\n    return 2 * x\n```")).reward.score == 0.0
    with pytest.raises(TypeError, match="task 'odd': the reward function has no verifier for str"):
        code_env.reset(Task("odd", (), "not a task"))


def test_run_episodes_batches_turns(sandbox, reward_fn):
    tasks = [PRODUCT, Task("two", ({"role": "user", "content": "1+1?"},), MathTask("2"))]
    envs = [ToolEnv(TOK, reward_fn, sandbox, max_turns=3, max_turn_tokens=256) for _ in tasks]
    batch_sizes = []

    def sample(contexts: list[list[int]]) -> list[list[int]]:
        batch_sizes.append(len(contexts))
        texts = [TOK.decode(c) for c in contexts]
        return [
            turn(f"\\boxed{{{last_output(t)}}}" if "<output>\n" in t else TOOL_CALL if "123" in t else "\\boxed{2}")
            for t in texts
        ]

    trajs = run_episodes(envs, tasks, sample)
    assert batch_sizes == [2, 1] and [t.task_id for t in trajs] == ["mul", "two"]
    assert [t.reward.score for t in trajs] == [1.0, 1.0] and [t.turns for t in trajs] == [2, 1]
    with pytest.raises(ValueError, match="separate env"):
        run_episodes([envs[0], envs[0]], tasks, sample)


def test_chat_template_tokenizer(sandbox, reward_fn):
    """A ChatML template writes a newline after the end-of-turn token; the observation carries it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["<tool>python\nprint(6 * 7)\n</tool> The answer is 42."] * 10,
        trainers.BpeTrainer(
            vocab_size=300,
            show_progress=False,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    root = f"memory://{uuid.uuid4().hex}/tok"
    chatml = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    for name, content in [
        ("tokenizer.json", bpe.to_str()),
        (
            "tokenizer_config.json",
            json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": chatml}),
        ),
    ]:
        with fsspec.open(f"{root}/{name}", "w") as f:
            f.write(content)
    tok = load_tokenizer(root)
    env = ToolEnv(tok, reward_fn, sandbox, max_turns=2, max_turn_tokens=128, system_prompt=None)
    task = Task("t", ({"role": "user", "content": "6 * 7?"},), MathTask("42"))
    call = "<tool>python\nprint(6 * 7)\n</tool>"
    traj = run_episode(env, task, scripted(call, lambda ctx: f"The answer is {last_output(ctx)}.", tok=tok))
    assert traj.reward.score == 1.0
    assert runs(traj.tokens, traj.loss_mask) == [turn(call, tok), turn("The answer is 42.", tok)]
    text = tok._tok.decode(traj.tokens, skip_special_tokens=False)
    assert "<|im_end|>\n<|im_start|>tool\n<output>\n42\n</output><|im_end|>\n<|im_start|>assistant\n" in text
