"""posttrain as an lm-eval model against lm-eval's own `hf` backend on one tiny Llama folder: per
request log-likelihoods (plain and rolling) within 1e-4 with the same greedy flags, identical
greedy generations cut at the same stop strings, equal task metrics; and the one-line error
without lm-eval."""

import importlib
import os
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402

from posttrain.eval.lm_model import greedy_until  # noqa: E402
from tests.support.hf import CHATML, make_hf_folder  # noqa: E402

CONTEXTS = ["What is 2+2?", "Be brief.", "And 3+3 is", "It is 4, na", "Be"]


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """(posttrain backend, hf backend) over one random tiny Llama folder (float32)."""
    from lm_eval.models.huggingface import HFLM

    from posttrain.eval.lm_harness import PosttrainLM

    root = str(tmp_path_factory.mktemp("tiny_llama"))
    config = {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML}
    make_hf_folder(root, config)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(root)
    posttrain = PosttrainLM(checkpoint=f"hf:{root}", batch_size=4)
    hf = HFLM(pretrained=root, batch_size=4, device="cpu", dtype="float32")
    posttrain.folder = root
    return posttrain, hf


def test_loglikelihood_parity(backends):
    posttrain, hf = backends
    pairs = [(c, x) for c in CONTEXTS for x in (" It is 4", "6.")] + [("", "naively")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    ours, theirs = posttrain.loglikelihood(reqs), hf.loglikelihood(reqs)
    assert len(ours) == len(reqs)
    np.testing.assert_allclose([s for s, _ in ours], [s for s, _ in theirs], atol=1e-4, rtol=0)
    assert [g for _, g in ours] == [g for _, g in theirs]
    # the model's own greedy next token as a continuation is flagged greedy by both
    ctx = posttrain.tok_encode(CONTEXTS[0])
    first = greedy_until(posttrain.model, [ctx], 1, [])[0]
    both = [b._loglikelihood_tokens([(None, ctx, first)])[0][1] for b in backends]
    assert both == [True, True]
    texts = [" ".join(CONTEXTS) * 4, "And 3+3"]  # the first is longer than max_length: two windows
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    assert len(posttrain.tok_encode(texts[0])) > posttrain.max_length
    np.testing.assert_allclose(posttrain.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling), atol=1e-4)


def gen(context: str, until: list[str], max_gen_toks: int) -> Instance:
    return Instance(
        "generate_until", {}, (context, {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}), 0
    )


def test_generation_parity(backends):
    posttrain, hf = backends
    reqs = [gen(c, until, 8) for c in CONTEXTS for until in (["\n"], [], ["a", "e"])]
    ours = posttrain.generate_until(reqs)
    assert ours == hf.generate_until(reqs)
    free = [o for o, r in zip(ours, reqs) if r.args[1]["until"] == []]
    cut = [o for o, r in zip(ours, reqs) if r.args[1]["until"] == ["a", "e"]]
    assert all(free) and not any("a" in o or "e" in o for o in cut) and cut != free
    with pytest.raises(ValueError, match="greedy only"):
        posttrain.generate_until([Instance("generate_until", {}, ("Be", {"do_sample": True, "temperature": 1.0}), 0)])


def test_task_metrics_equal(backends):
    import lm_eval

    from posttrain.eval.lm_harness import suite_metrics, task_manager

    posttrain, hf = backends
    tasks = ["posttrain_arithmetic_choice", "posttrain_arithmetic"]
    kw = dict(tasks=tasks, limit=6, task_manager=task_manager(), bootstrap_iters=0, log_samples=False)
    ours, theirs = (lm_eval.simple_evaluate(model=m, **kw) for m in backends)
    for task in tasks:
        assert suite_metrics(ours, task) == suite_metrics(theirs, task)
    assert set(suite_metrics(ours, tasks[0])) == {"acc", "acc_norm", "sample_len"}
    assert set(suite_metrics(ours, tasks[1])) == {"exact_match@first-number", "sample_len"}


CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And 3+3 is"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4"}],
]


def test_chat_template_parity(backends, monkeypatch):
    """lm-eval's --apply_chat_template: the same prompt text as the hf backend (a generation prompt,
    or the last assistant message continued), the same template, the same task metrics."""
    import lm_eval

    from posttrain.data.chat_template import compile_template
    from posttrain.eval.lm_harness import suite_metrics, task_manager

    posttrain, hf = backends
    for chat in CHATS:
        assert posttrain.apply_chat_template(chat) == hf.apply_chat_template(chat)
    continued = posttrain.apply_chat_template(CHATS[2], add_generation_prompt=False)
    assert continued == hf.apply_chat_template(CHATS[2], add_generation_prompt=False) and continued.endswith("It is 4")
    assert posttrain.chat_template(True) == hf.chat_template(True) == CHATML and posttrain.chat_template(False) is None
    kw = dict(tasks=["posttrain_arithmetic"], limit=4, task_manager=task_manager(), bootstrap_iters=0)
    kw.update(apply_chat_template=True, log_samples=True)
    ours, theirs = (lm_eval.simple_evaluate(model=m, **kw) for m in backends)
    assert suite_metrics(ours, "posttrain_arithmetic") == suite_metrics(theirs, "posttrain_arithmetic")
    prompt = ours["samples"]["posttrain_arithmetic"][0]["arguments"]
    assert str(prompt).count("<|im_start|>") >= 2, prompt  # user turn and the generation prompt
    # a template that refuses system messages renders the chat without them
    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + CHATML
    monkeypatch.setattr(posttrain.tok, "_template", compile_template(no_system))
    assert posttrain.apply_chat_template(CHATS[1]) == hf.apply_chat_template(CHATS[1][1:])


def test_found_by_name_from_python_and_the_command_line(backends, monkeypatch):
    import lm_eval
    import lm_eval.__main__

    from posttrain.eval import lm_eval_cli
    from posttrain.eval.lm_harness import TASKS_DIR, suite_metrics, task_manager

    task, args = "posttrain_arithmetic_choice", f"checkpoint=hf:{backends[0].folder},batch_size=4"
    kw = dict(tasks=[task], limit=4, task_manager=task_manager(), bootstrap_iters=0, log_samples=False)
    by_name = lm_eval.simple_evaluate(model="posttrain", model_args=args, **kw)
    assert suite_metrics(by_name, task) == suite_metrics(lm_eval.simple_evaluate(model=backends[1], **kw), task)
    seen = []
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the wrapper sets lm-eval's argv: restored after
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    assert lm_eval_cli.main(["--model", "posttrain", "--model_args", args, "--tasks", task]) == 0
    assert seen[-1][1:] == ["--model", "posttrain", "--model_args", args, "--tasks", task, "--include_path", TASKS_DIR]
    lm_eval_cli.main(["--tasks", task, "--include_path=/mine"])
    assert seen[-1][1:] == ["--tasks", task, "--include_path=/mine"]


def test_bad_model_args(backends):
    from posttrain.eval.lm_harness import PosttrainLM

    with pytest.raises(ValueError, match="checkpoint="):
        PosttrainLM()
    with pytest.raises(ValueError, match="batch_size=auto"):
        PosttrainLM(model=backends[0].model, batch_size="auto")


def test_missing_lm_eval_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "posttrain.eval.lm_harness", raising=False)
    with pytest.raises(ImportError) as e:
        importlib.import_module("posttrain.eval.lm_harness")
    assert "pip install 'posttrain[eval]'" in str(e.value) and "\n" not in str(e.value)


def test_gguf_checkpoint_is_converted_once(tmp_path, monkeypatch):
    """`gguf:FILE` becomes an HF folder in the cache, written once per file (the conversion itself:
    tests/models/hf/test_gguf.py)."""
    from posttrain.eval.lm_model import resolve_spec
    from posttrain.models.hf import gguf

    calls = []

    def convert(path, out, progress=True):
        calls.append(path)
        os.makedirs(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write('{"architectures": ["LlamaForCausalLM"]}')

    monkeypatch.setattr(gguf, "gguf_to_hf", convert)
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    path, folder = resolve_spec(f"gguf:{tmp_path / 'tiny.gguf'}")
    assert path == f"hf:{folder}" and folder.startswith(str(tmp_path / "cache" / "gguf" / "tiny-"))
    assert resolve_spec(f"gguf:{tmp_path / 'tiny.gguf'}") == (path, folder) and len(calls) == 1
    assert resolve_spec(folder) == (f"hf:{folder}", folder)  # a plain HF folder is read as one
    assert resolve_spec(str(tmp_path)) == (str(tmp_path), None)  # anything else: a run's workdir
    with pytest.raises(FileNotFoundError, match="gguf:.*no such GGUF file"):
        resolve_spec(f"gguf:{tmp_path / 'none.gguf'}")
