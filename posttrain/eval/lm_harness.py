"""posttrain as an lm-eval model: `--model posttrain --model_args checkpoint=SPEC[,max_length=0,
max_gen_toks=256,step=N] --batch_size 16`, SPEC a run's workdir, `hf:FOLDER` or `gguf:FILE`
(`eval/lm_model.py`). Importing this module registers the model with lm-eval's registry;
lm-eval 0.4.13 has no plugin entry points for models, so its own `lm_eval` command cannot find it:
run `python -m posttrain.eval.lm_eval_cli` (lm-eval's command line, this model registered and
posttrain's offline tasks on the include path), or from Python

    import posttrain.eval.lm_harness as harness
    harness.simple_evaluate(model="posttrain", model_args="checkpoint=hf:/models/x", tasks=["posttrain_gsm8k"])

Requests are served as lm-eval's `hf` backend serves them, on posttrain's sharded forward and
KV-cache sampler: the same tokenization (the tokenizer's special tokens added, a BOS-prefixed
string left alone), longest requests first in batches of `batch_size`, contexts truncated from the
left to `max_length`, rolling windows for perplexity, greedy generation that stops at the
tokenizer's stop ids, `max_gen_toks` or the first `until` string (the text is cut there), and
`--apply_chat_template` renders prompts with the checkpoint's chat template as the hf backend does
(a template that refuses a system message is tried again without it). Sampled generation
(`do_sample`) is refused: this backend evaluates greedily.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from pathlib import Path

try:
    import lm_eval
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
except ImportError as e:  # one line, naming the extra that installs it
    raise ImportError(
        f"lm-eval tasks need the lm-eval package ({e.name} is missing): pip install 'posttrain[eval]'"
    ) from e
from tqdm import tqdm

from posttrain.core.compile_cache import enable_compilation_cache
from posttrain.eval.lm_model import LoadedModel, greedy_until, load_checkpoint, score_rows

log = logging.getLogger(__name__)
TASKS_DIR = str(Path(__file__).parent / "lm_tasks")  # posttrain's offline task definitions


def _int(value, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--model_args {name}={value!r}: expected an integer") from None


@register_model("posttrain")
class PosttrainLM(TemplateLM):
    """lm-eval's model interface over a posttrain model (module docstring)."""

    def __init__(
        self,
        checkpoint: str = "",
        batch_size: int | str = 16,
        max_length: int = 0,
        max_gen_toks: int = 256,
        step: int | None = None,
        model: LoadedModel | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
    ) -> None:
        """Load `checkpoint` (or take an already loaded `model`); `device` and `max_batch_size`,
        which lm-eval's command line always passes, are the JAX platform's and `batch_size`'s."""
        super().__init__()
        if (model is None) == (not checkpoint):
            raise ValueError("posttrain lm-eval model: give --model_args checkpoint=RUN_DIR|hf:FOLDER|gguf:FILE")
        if str(batch_size).startswith("auto"):
            raise ValueError("posttrain lm-eval model: batch_size=auto is not supported; give an integer")
        self.batch_size_per_call = _int(batch_size, "batch_size")
        self._max_gen_toks = _int(max_gen_toks, "max_gen_toks")
        if model is None:  # on its own (not in a run, which has its cache set): JAX's persistent cache
            enable_compilation_cache("auto")
            step = None if step is None else _int(step, "step")
            model = load_checkpoint(checkpoint, max_length=_int(max_length, "max_length"), step=step)
        elif max_length:
            raise ValueError("posttrain lm-eval model: max_length is the loaded model's (LoadedModel.max_length)")
        self.model, self.tok = model, model.tok
        del max_batch_size, device  # lm-eval's defaults ("cuda:0"): posttrain runs on the JAX platform

    @property
    def eot_token_id(self) -> int:
        """The end-of-text id (lm-eval's eot)."""
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context becomes: BOS, else EOS (as the hf backend)."""
        return self.tok.eos_id if self.tok.bos_id is None else self.tok.bos_id

    @property
    def max_length(self) -> int:
        """The longest row a request may use (contexts are truncated from the left to fit)."""
        return self.model.max_length

    @property
    def max_gen_toks(self) -> int:
        """New tokens when a task names none."""
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's folder, for lm-eval's request cache (as the hf backend names it)."""
        return self.tok.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The checkpoint's chat template (None when lm-eval applies none); templates by name
        other than "default" are not kept."""
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str) and chat_template != "default":
            raise ValueError(f"posttrain lm-eval model: chat template {chat_template!r}: only the default one is kept")
        return self.tok.chat_template_source

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The few-shot chat as the prompt text; without `add_generation_prompt` the last
        (assistant) message is continued. A template that raises on the system message is rendered
        without it, as the hf backend does."""
        kw = dict(add_generation_prompt=add_generation_prompt, continue_final_message=not add_generation_prompt)
        try:
            return self.tok.render_chat(chat_history, **kw)
        except ValueError:
            log.warning("chat template failed; rendering the chat again without its system messages")
            return self.tok.render_chat([m for m in chat_history if m["role"] != "system"], **kw)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None):
        """Token ids of `string`, with the tokenizer's special tokens unless it starts with the
        prefix token's text (as the hf backend); the last `left_truncate_len` of them if given."""
        if add_special_tokens is None:
            prefix = self.tok.token_text(self.prefix_token_id)
            add_special_tokens = not (prefix and string.startswith(prefix))
        ids = self.tok.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens) -> str:
        """Text of `tokens`, special tokens dropped."""
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_) -> list[tuple[float, bool]]:
        """(log p(continuation | context), continuation is greedy) per (key, context ids, continuation ids)."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        out = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="posttrain loglikelihood")
        for chunk in order.get_batched(n=self.batch_size_per_call):
            rows = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in chunk]
            for (key, _, cont), (logp, greedy) in zip(chunk, score_rows(self.model, rows)):
                answer = (float(logp[-len(cont) :].sum()), bool(greedy[-len(cont) :].all()))
                out.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return order.get_original(out)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings, in disjoint windows of `max_length` (as the hf backend)."""
        windows, counts = [], []
        for (string,) in [r.args for r in requests]:
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            found = [(None, *lm_utils.make_disjoint_window(w)) for w in rolling]
            windows += found
            counts.append(len(found))
        scores = [s for s, _ in self._loglikelihood_tokens(windows, disable_tqdm=True)] if windows else []
        out, at = [], 0
        for req, n in zip(requests, counts):
            out.append(sum(scores[at : at + n]))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, out[-1])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first `until` string, grouped by generation kwargs and
        longest context first."""
        order = Collator(
            [r.args for r in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        out = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="posttrain generate_until")
        for chunk in order.get_batched(n=self.batch_size_per_call):
            contexts, kwargs = zip(*chunk)
            gen = normalize_gen_kwargs(dict(kwargs[0]), self.max_gen_toks)
            if gen.get("do_sample") or float(gen.get("temperature") or 0.0) > 0:
                raise ValueError(f"posttrain lm-eval model: greedy only, got do_sample/temperature in {kwargs[0]}")
            until, new = handle_stop_sequences(gen.pop("until", None), eos=None), gen.pop("max_gen_toks")
            if new >= self.max_length:
                raise ValueError(f"max_gen_toks={new} must be below the model's max_length={self.max_length}")
            rows = [self.tok_encode(c, left_truncate_len=self.max_length - new) for c in contexts]
            for context, ids in zip(contexts, greedy_until(self.model, rows, new, until)):
                text = postprocess_generated_text(self.tok_decode(ids), until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, kwargs[0]), text)
                bar.update(1)
        bar.close()
        return order.get_original(out)


@functools.cache
def task_manager(include_defaults: bool = False):
    """lm-eval's TaskManager over posttrain's offline tasks (`TASKS_DIR`); `include_defaults`: also
    lm-eval's own (a scan of several thousand task files: seconds). One per process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=TASKS_DIR, include_defaults=include_defaults)


def simple_evaluate(**kwargs) -> dict:
    """`lm_eval.simple_evaluate` with posttrain's tasks found (a `task_manager` given wins)."""
    kwargs.setdefault("task_manager", task_manager(include_defaults=True))
    return lm_eval.simple_evaluate(**kwargs)


def find_tasks(tasks: list[str]):
    """The TaskManager that knows every task of `tasks`: posttrain's own when it does (fast), else
    one with lm-eval's tasks too; an unknown name is an error naming posttrain's tasks."""
    manager = task_manager()
    if all(t in manager.all_subtasks for t in tasks):
        return manager
    manager = task_manager(include_defaults=True)
    unknown = [t for t in tasks if t not in manager.all_subtasks]
    if unknown:
        raise ValueError(
            f"unknown lm-eval task(s) {unknown}: posttrain's offline tasks are {', '.join(task_manager().all_subtasks)}"
            " (lm-eval's own: `python -m posttrain.eval.lm_eval_cli ls tasks`)"
        )
    return manager


def task_metric_names(task: str, manager) -> list[str]:
    """The metrics `suite_metrics` reports for `task`, from its configuration (no data read):
    each metric under each filter (`metric@filter`), the sample count, the wall time."""
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY

    cfg = manager.task_index[task].cfg or {}
    metrics = [str(m["metric"]) for m in cfg.get("metric_list") or []]
    metrics = metrics or DEFAULT_METRIC_REGISTRY[cfg.get("output_type") or "generate_until"]
    filters = [f["name"] for f in cfg.get("filter_list") or []] or ["none"]
    return [m if f == "none" else f"{m}@{f}" for m in metrics for f in filters] + ["sample_len", "seconds"]


def suite_metrics(results: dict, task: str) -> dict[str, float]:
    """lm-eval's numbers for `task` as posttrain suite metrics: `metric,filter` → `metric@filter`
    (`metric` for the filter "none"), standard errors and aliases dropped."""
    out = {}
    for key, value in results["results"][task].items():
        metric, _, filt = key.partition(",")
        if metric.endswith("_stderr") or not isinstance(value, int | float) or isinstance(value, bool):
            continue
        out[metric if filt in ("", "none") else f"{metric}@{filt}"] = float(value)
    return out


def evaluate_tasks(model: LoadedModel, tasks: list[str], *, limit: int, batch_size: int) -> dict:
    """Run lm-eval `tasks` on an already loaded model: {task: (its `suite_metrics` and seconds,
    a version: a hash of the task's configuration as lm-eval ran it and the limit)}."""
    lm, manager, out = PosttrainLM(model=model, batch_size=batch_size), find_tasks(tasks), {}
    for task in tasks:
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(
            model=lm, tasks=[task], limit=limit, task_manager=manager, bootstrap_iters=0, log_samples=False
        )
        named = lambda o: getattr(o, "__qualname__", type(o).__name__)  # functions by name, not address
        config = json.dumps([results["configs"][task], limit], sort_keys=True, default=named)
        version = hashlib.sha256(config.encode()).hexdigest()[:16]
        out[task] = ({**suite_metrics(results, task), "seconds": time.perf_counter() - start}, version)
    return out
