"""``ringray``: an lm_eval model whose every forward goes round ringray's ring.

    lm_eval --model ringray --model_args pretrained=ckpt/ --tasks ...            # cp = 1
    python -m ringray.harness --cp 4 -- --model ringray \\
        --model_args pretrained=ckpt/,cp=4,rope.scaling=yarn,rope.factor=4,max_length=32768 \\
        --tasks ...

(``--model_args``: :mod:`ringray.harness.options`.) Requests are tokenized exactly as
lm_eval's ``hf`` model tokenizes them, with the checkpoint's own tokenizer through
``transformers.AutoTokenizer`` (local files only): context and continuation are encoded
together and split at the context's length, trailing context spaces move to the
continuation, an empty context becomes the prefix token (BOS, else EOS), a context longer
than ``max_length`` is cut from the left, rolling log-likelihoods use lm_eval's own rolling
windows, and generation contexts are encoded and left-truncated as hf encodes them. So on the
same checkpoint the numbers equal ``hf``'s up to float32 rounding (the tests compare them).

What is exact and what is simplified:

- **loglikelihood**: exact. Requests whose inputs are the same token sequence (a context
  with several one-token continuations) share one forward, as hf's logits cache does.
  Inputs are sorted longest first and run ``batch_size`` at a time, right-padded.
- **loglikelihood_rolling**: exact; each window is a loglikelihood request.
- **generate_until**: greedy decoding only (``do_sample`` true or a temperature above 0 is
  refused), for up to ``batch_size`` requests at a time. With ``kv_cache`` (the default)
  the prompts run over the ring once, each rank keeping its share of every layer's K/V
  (:mod:`ringray.harness.kv_cache`), and each new token runs alone: its attention reads
  every rank's cached share and merges the partial results over the ring by their
  log-sum-exp. That is exact attention, as the full forward is, but not the same float32
  arithmetic (another summation order, like hf's own cached ``generate``): logits agree to
  ~1e-6 relative, as the padded ring forward and a plain forward do, so the greedy text is
  the same unless two tokens tie to that precision. Finished rows stay in the batch until
  all are done (their extra tokens are dropped). With ``kv_cache=false`` each new token
  re-runs the whole prefix over the ring instead: simple, the reference, and far slower on
  long contexts. Either way it stops, as hf's ``generate`` does, at the checkpoint's EOS
  ids (generation_config.json, else config.json), when a stop string appears in the
  decoded last tokens (lm_eval's own stopping criteria), or after ``max_gen_toks``; the
  text is cut at the first stop string.
- Not supported: data parallelism inside lm_eval (``world_size`` is 1: the ranks of the
  ring hold one model), sampling, ``think_end_token``, multimodal requests.

lm_eval sees one model on rank 0. With ``cp > 1`` the other ranks run
:func:`ringray.harness.ring.serve`, and every forward is broadcast to them first
(:class:`~ringray.harness.ring.Lockstep`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    configure_pad_token,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.models.utils_hf import MultiTokenEOSCriteria
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ringray.harness.options import HarnessOptions
from ringray.harness.ring import Lockstep, group_size

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256
"""New tokens a generation request may make unless it says otherwise (hf's default)."""

Scored = tuple[tuple[str, str] | None, list[int], list[int]]
"""A loglikelihood request as tokens: (its strings or None, context ids, continuation ids)."""


def _eos_ids(path: str) -> list[int]:
    """The ids ``generate`` stops at: generation_config.json's ``eos_token_id``, else
    config.json's (an int or a list of them)."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        with open(file, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


@register_model("ringray")
class RingLM(TemplateLM):
    """An lm_eval model backed by ringray's ring (see the module docstring). Keyword
    arguments are ``--model_args`` (:class:`~ringray.harness.options.HarnessOptions`); ``cp``
    defaults to the process group's size (1 without one). Built on rank 0 only; with
    ``cp > 1`` it makes the other ranks build the same engine, and :meth:`close` (or the
    launcher, when lm_eval returns) releases them.

    Raises:
        ValueError: one line, for an unknown or bad argument, a checkpoint ringray cannot
            read, or a ``cp`` that does not match the process group.
    """

    def __init__(self, **model_args: object) -> None:
        super().__init__()
        if model_args.get("cp") is None:  # the ring is the whole process group, if any
            model_args = {**model_args, "cp": group_size()}
        self.options = HarnessOptions.from_model_args(model_args)
        path = self.options.pretrained
        if not os.path.isdir(path):
            raise ValueError(f"pretrained: {path!r} is not a directory; give a local Hugging "
                             f"Face checkpoint (nothing is downloaded)")
        tokenizer_args: dict[str, object] = {"use_fast": True, "local_files_only": True}
        if self.options.add_bos_token is not None:
            tokenizer_args["add_bos_token"] = self.options.add_bos_token
        self.hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            self.options.tokenizer or path, **tokenizer_args)
        self.tokenizer = configure_pad_token(tokenizer, model_config=self.hf_config)
        self.add_bos_token = self.options.add_bos_token
        self.eos_ids = _eos_ids(path)
        self.ring = Lockstep(self.options)
        self._device = self.ring.engine.device

    # ------------------------------------------------------------------ lm_eval's API
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.options.prefix_token_id is not None:
            return self.options.prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """``max_length``, else what hf reads: config.json's context length, then the
        tokenizer's ``model_max_length``."""
        if self.options.max_length:
            return self.options.max_length
        return resolve_max_length(self.hf_config, self.tokenizer)

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_MAX_GEN_TOKS

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: object) -> list[int]:
        """Token ids as hf makes them: ``add_special_tokens`` if given, else
        ``add_bos_token`` if set, else the tokenizer's default; none added to a string that
        already starts with the prefix token's text."""
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        if add_special_tokens is None and has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    def close(self) -> None:
        """Release the other ranks of the ring (they leave ``serve``)."""
        self.ring.close()

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests: list[Scored], disable_tqdm: bool = False,
                              **kwargs: object) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy)`` of each request, in order.

        A request's input is ``(context + continuation)[-(max_length + 1):][:-1]``, as hf
        cuts it; its last ``len(continuation)`` positions are scored against the
        continuation."""
        inputs: dict[tuple[int, ...], int] = {}  # distinct input -> its index
        plans = []  # per request: (input index, input length, continuation)
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("loglikelihood: a request has no context or continuation "
                                 "tokens")
            if len(continuation) > self.max_length:
                raise ValueError(f"loglikelihood: a continuation of {len(continuation)} "
                                 f"tokens is longer than max_length={self.max_length}")
            whole = (context + continuation)[-(self.max_length + 1):]
            key = tuple(whole[:-1])
            index = inputs.setdefault(key, len(inputs))
            plans.append((index, len(key), continuation))
        distinct = list(inputs)
        by_input: dict[int, list[int]] = {}
        for request, (index, _, _) in enumerate(plans):
            by_input.setdefault(index, []).append(request)
        # longest first, as hf runs them (a batch is as long as its first input)
        order = sorted(range(len(distinct)), key=lambda i: (-len(distinct[i]), distinct[i]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm,
                        desc="Running loglikelihood requests (ringray)")
        for first in range(0, len(order), self.batch_size):
            batch = order[first:first + self.batch_size]
            width = len(distinct[batch[0]])
            tokens = torch.zeros(len(batch), width, dtype=torch.long)
            members = [r for i in batch for r in by_input[i]]
            rows = torch.empty(len(members), dtype=torch.long)
            targets = torch.full((len(members), width), -1, dtype=torch.long)
            row_of = {}
            for row, index in enumerate(batch):
                tokens[row, :len(distinct[index])] = torch.tensor(distinct[index])
                row_of[index] = row
            for slot, request in enumerate(members):
                index, length, continuation = plans[request]
                rows[slot] = row_of[index]
                targets[slot, length - len(continuation):length] = torch.tensor(continuation)
            sums = self.ring.score(tokens, rows, targets)
            for slot, request in enumerate(members):
                answer = (float(sums[slot, 0]), bool(sums[slot, 1] == 0))
                results[request] = answer
                strings = requests[request][0]
                if strings is not None:
                    self.cache_hook.add_partial("loglikelihood", strings, answer)
            progress.update(len(members))
        progress.close()
        return results

    def loglikelihood_rolling(self, requests: list[Instance],
                              disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood over lm_eval's disjoint rolling windows of
        ``max_length`` tokens, the first predicted from the prefix token (as hf)."""
        windows: list[Scored] = []
        counts = []
        for (string,) in [request.args for request in requests]:
            pieces = [make_disjoint_window(window) for window in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows.extend((None, context, continuation) for context, continuation in pieces)
            counts.append(len(pieces))
        scored = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals, start = [], 0
        for request, count in zip(requests, counts, strict=True):
            total = sum(logprob for logprob, _ in scored[start:start + count])
            start += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def _context_ids(self, context: str, max_context: int) -> list[int]:
        """A generation context's ids as hf's batch encoding makes them, cut from the left
        to ``max_context``."""
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        ids = self.tokenizer(context, **special)["input_ids"]
        return ids[-max_context:] if max_context else ids

    def generate_until(self, requests: list[Instance],
                       disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (see the module docstring for what stops them)."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(index)
        progress = tqdm(total=len(requests), disable=disable_tqdm,
                        desc="Running generate_until requests (ringray)")
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.pop("do_sample", False):
                raise ValueError(f"generate_until: ringray decodes greedily; sampling "
                                 f"(do_sample or temperature > 0) is not supported, got "
                                 f"{gen_kwargs}")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = kwargs.pop("max_gen_toks")
            max_context = self.max_length - max_gen_toks
            if max_context <= 0:
                raise ValueError(f"generate_until: max_gen_toks={max_gen_toks} leaves no room "
                                 f"for a context in max_length={self.max_length}")
            total_length = kwargs.pop("max_length", None)
            kwargs.pop("temperature", None)
            if kwargs:
                log.warning("ringray generate_until: ignoring %s (greedy decoding)",
                            sorted(kwargs))
            contexts = [(i, self._context_ids(requests[i].args[0], max_context))
                        for i in indices]
            contexts.sort(key=lambda item: -len(item[1]))
            for first in range(0, len(contexts), self.batch_size):
                batch = contexts[first:first + self.batch_size]
                texts = self._generate([ids for _, ids in batch], until=until,
                                       max_gen_toks=max_gen_toks, total_length=total_length)
                for (index, _), text in zip(batch, texts, strict=True):
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                progress.update(len(batch))
        progress.close()
        return results

    def _generate(self, contexts: list[list[int]], *, until: list[str], max_gen_toks: int,
                  total_length: int | None) -> list[str]:
        """Greedy decoding of a batch of contexts, in lockstep: each step appends every
        unfinished sequence's argmax, from the KV cache (one prefill, then one token a step)
        or, without ``kv_cache``, by running its whole prefix over the ring again."""
        sequences = [list(ids) for ids in contexts]
        limits = [(total_length - len(ids)) if total_length is not None else max_gen_toks
                  for ids in contexts]
        stops = [[MultiTokenEOSCriteria(text, self.tokenizer, len(ids), 1) for text in until]
                 for ids in contexts]
        active = [i for i, limit in enumerate(limits) if limit > 0]
        if active and self.options.kv_cache:
            rows = active  # every row stays in the cache until the last one is done
            tokens, lengths = self._batch([sequences[i] for i in rows])
            chosen = self.ring.prefill(tokens, lengths).tolist()
            active = self._extend(active, rows, chosen, sequences, contexts, stops, limits)
            while active:
                chosen = self.ring.decode(torch.tensor(chosen)).tolist()
                active = self._extend(active, rows, chosen, sequences, contexts, stops, limits)
        while active:  # without the cache
            tokens, lengths = self._batch([sequences[i] for i in active])
            chosen = self.ring.argmax(tokens, lengths - 1).tolist()
            active = self._extend(active, active, chosen, sequences, contexts, stops, limits)
        texts = []
        for ids, sequence in zip(contexts, sequences, strict=True):
            text = self.tok_decode(sequence[len(ids):])
            texts.append(postprocess_generated_text(text, until, None))
        return texts

    @staticmethod
    def _batch(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences right-padded into one ``(rows, longest)`` tensor, and their lengths."""
        lengths = torch.tensor([len(ids) for ids in sequences])
        tokens = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
        for row, ids in enumerate(sequences):
            tokens[row, :len(ids)] = torch.tensor(ids)
        return tokens, lengths

    def _extend(self, active: list[int], rows: list[int], chosen: list[int],
                sequences: list[list[int]], contexts: list[list[int]],
                stops: list[list[MultiTokenEOSCriteria]], limits: list[int]) -> list[int]:
        """Append each active sequence's chosen token (``chosen[k]`` is row ``rows[k]``'s);
        the active ones that go on: no EOS id, no stop string, under their limit."""
        still = []
        for i, token in zip(rows, chosen, strict=True):
            if i not in active:
                continue
            sequences[i].append(token)
            ids = torch.tensor([sequences[i]])
            stopped = any(stop(ids, None) for stop in stops[i])
            generated = len(sequences[i]) - len(contexts[i])
            if token not in self.eos_ids and not stopped and generated < limits[i]:
                still.append(i)
        return still
