"""The offline API, shaped like vLLM's ``LLM``: batch generation from Python."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any, cast

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig, check_engine_kwargs
from pagedllm.engine.input_processor import require_valid_unicode, token_id_list
from pagedllm.engine.llm_engine import (
    LLMEngine,
    QueueFullError,
    check_cache_salt,
    check_priority,
)
from pagedllm.model.loader import LoadedModel
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate completions for many prompts with continuous batching over a paged KV cache.

    Args:
        model: GGUF file, Hugging Face folder or bundled model's short name (``"smollm2-135m"``,
            ``"gemma-3-270m"``); None = the bundled SmolLM2-135M-Instruct.
        loaded: an already loaded model to reuse (tests share one); None = load ``model``.
        kv_stats: give ``engine.stats`` the paper-figure KV accounting (waste, batch size,
            sharing; see ``LLMEngine.enable_kv_stats``); default True.
        **engine_kwargs: any ``EngineConfig`` field, with the same defaults and meaning as the
            ``--<field>`` flags of ``pagedllm generate`` / ``serve``: ``dtype``, ``block_size``,
            ``kv_cache_memory`` (bytes or a size such as ``"2GiB"``), ``max_num_seqs``,
            ``max_model_len``, ``chat_template`` (a Jinja file used instead of the model's
            template by ``chat``), ``attention_backend``, ``tensor_parallel_size`` (> 1 starts
            worker processes, or Ray actors with ``distributed_executor_backend="ray"``, which
            stop with ``shutdown()``, when the ``LLM`` is garbage collected, or at exit), ...

    Raises:
        TypeError: naming any keyword that is no ``EngineConfig`` field.
        ValueError: naming the field of an invalid value.
        FileNotFoundError: when ``model`` does not exist.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        loaded: LoadedModel | None = None,
        kv_stats: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        config = self.build_config(model, **engine_kwargs)
        self.engine = LLMEngine(config, loaded=loaded)
        self.engine.enable_kv_stats(kv_stats)
        self._ids = itertools.count()

    @staticmethod
    def build_config(model: str | None = None, **engine_kwargs: Any) -> EngineConfig:
        """The ``EngineConfig`` that ``LLM(model, **engine_kwargs)`` runs with, without loading
        anything.

        Raises:
            TypeError: naming any keyword that is no ``EngineConfig`` field.
            ValueError: naming the field of an invalid value.
        """
        check_engine_kwargs(engine_kwargs, "LLM")
        return EngineConfig(model=model, **engine_kwargs)

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any; idempotent."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no live request holds, so the next ``generate`` recomputes
        its prompts (as vLLM's ``LLM.reset_prefix_cache``). Returns the number of blocks dropped."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (with the ``chat_template`` option applied, if one was given)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in input order.

        Args:
            prompts: a string, a list of token ids, ``{"prompt_token_ids": [...]}`` or
                ``{"prompt": "..."}`` (either dict may add ``"cache_salt"``: prompts with
                different salts never share prefix-cache blocks, as vLLM's prompt dicts; with
                both keys, ``prompt_token_ids`` is what runs, as in vLLM), or a list of those.
            sampling_params: one for all prompts or one per prompt (default greedy-free
                ``SamplingParams()``).
            use_tqdm: show a progress bar.
            priority: one scheduling priority per prompt (lower = served first, ties by
                order) when the engine runs ``scheduling_policy="priority"``; default all 0.

        Raises:
            ValueError: naming the field of the first invalid prompt or parameter (``priority``:
                a length that differs from the prompts', or nonzero under ``fcfs``;
                ``cache_salt``: not a non-empty string); no request is queued then.
            QueueFullError: more prompts than ``max_waiting_requests`` allows; none queued.
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, Seq):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: got {len(sampling_params)} for {len(prompt_list)} prompts"
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)

        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompt_list)} prompts")
        engine = self.engine
        # Validate everything first, so one bad prompt queues nothing.
        resolved = []
        for p, sp, prio in zip(prompt_list, params_list, priorities, strict=True):
            ids = _prompt_ids(engine, p)
            engine.validate_request(ids, sp)
            check_priority(prio, engine.config.scheduling_policy)
            salt = p.get("cache_salt") if isinstance(p, dict) else None
            check_cache_salt(salt)
            resolved.append((p, ids, sp, prio, salt))
        limit = engine.config.max_waiting_requests
        if limit is not None and len(engine.scheduler.waiting) + len(resolved) > limit:
            raise QueueFullError(
                f"{len(resolved)} prompts do not fit max_waiting_requests ({limit}); "
                "generate fewer at a time"
            )
        request_ids = []
        for p, ids, sp, prio, salt in resolved:
            rid = str(next(self._ids))
            engine.add_request(
                rid, p if isinstance(p, str) else ids, sp, cache_salt=salt, priority=prio
            )
            request_ids.append(rid)
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Seq[PromptType],
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        n: int | None = None,
        ignore_eos: bool = False,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search inside the engine: each step keeps the ``beam_width`` best candidates,
        forking their parents' KV blocks (a block tree) and freeing dropped beams.

        Beams are ranked by ``cumulative_logprob / generated_len ** length_penalty`` (the
        prompt length does not count), with transformers' early-stopping rules (True, False,
        "never"). Returns, per prompt, the best ``n`` (default ``beam_width``) hypotheses.

        Raises:
            ValueError: naming the field for invalid values.
        """
        params = SamplingParams(
            n=n or beam_width,
            best_of=beam_width,
            use_beam_search=True,
            temperature=0.0,
            length_penalty=length_penalty,
            early_stopping=early_stopping,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
        )
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Embed prompts: each is prefilled (batched like any request) and its final hidden
        states (after the final norm) pooled (``engine.pooling``: the engine's ``pooling``
        option, mean by default, or last token; L2-normalized unless ``normalize=False``). Prefix-cache hits are not taken.

        Returns:
            one ``RequestOutput`` per prompt, in order, with ``embedding`` (``hidden_size``
            floats) set and no generated tokens.

        Raises:
            ValueError: naming the field (``prompt``: empty, outside the vocabulary, longer than
                ``max_model_len``).
        """
        params = SamplingParams(
            max_tokens=1,
            detokenize=False,
            pooling=pooling_params or PoolingParams(self.engine.config.pooling),
        )
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template (``chat_template`` if given, else the model's) to one
        conversation or a list of them, then generate.

        Raises:
            ValueError: naming ``messages`` when a conversation is empty or a message is
                malformed (``template_messages``), or when the model has no chat template and
                none was given (``chat_template``).
        """
        conversations = cast(
            list[list[dict[str, Any]]],
            [messages] if messages and isinstance(messages[0], dict) else messages,
        )
        prompts: list[PromptType] = []
        for conv in conversations:
            if not conv:
                raise ValueError("messages must not be empty")
            prompts.append(
                {
                    "prompt_token_ids": apply_chat_template(
                        self.engine.tokenizer,
                        template_messages(conv),
                        add_generation_prompt,
                        continue_final_message,
                    )
                }
            )
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            while len(done) < len(wanted) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in wanted - done.keys():  # e.g. KeyboardInterrupt: leave no blocks behind
                engine.abort_request(rid)
        return [done[r] for r in request_ids]


#: Chat roles served (OpenAI's; ``function`` is the legacy form of ``tool``).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def template_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of ``LLM.chat`` as the chat template takes them, checked as the server
    checks them: a known role, and a content that is a string (null: an assistant message
    with tool calls) or a list of ``{"type": "text", "text": ...}`` parts, joined with newlines
    as the server joins them.

    Raises:
        ValueError: naming ``messages[i]`` and what is wrong.
    """
    out = []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m.get('role')!r}"
            )
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(
                        f"messages[{i}].content: only text parts are supported, got {kind!r}"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content: a text part needs a 'text' string")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        elif content is None and not (m.get("role") == "assistant" and m.get("tool_calls")):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text parts (null is only "
                "valid on an assistant message with tool calls)"
            )
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of text parts, got "
                f"{type(content).__name__}"
            )
        out.append(m)
    return out


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template (or
    ``chat_template``, a Jinja template given for this call), ``template_kwargs`` passed to the
    template as extra variables; the template receives ``tools`` (OpenAI-shaped dicts) when
    given.

    Raises:
        ValueError: naming ``messages`` if the template cannot render them, or if the model has
            no chat template (a base model such as gemma-3-270m): the message says to pass
            ``--chat-template`` (the server answers 400 with it).
    """
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "messages cannot be rendered: this model has no chat template (a base model); pass "
            "one with --chat-template FILE (LLM(chat_template=...)) or use completions instead"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template=chat_template,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja errors, bad roles
        raise ValueError(f"messages could not be rendered by the chat template: {e}") from e
    require_valid_unicode(text, "messages")
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _as_prompt_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt of token ids
    return list(cast(Seq[PromptType], prompts))


def _prompt_ids(engine: LLMEngine, p: PromptType) -> list[int]:
    if isinstance(p, str):
        return engine.tokenize(p) if p else []
    if isinstance(p, dict):
        if "prompt_token_ids" in p:  # wins over "prompt", as in vLLM's prompt dicts
            return token_id_list(p["prompt_token_ids"])
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise ValueError(f"prompt must be a string, got {type(p['prompt']).__name__}")
            return engine.tokenize(p["prompt"]) if p["prompt"] else []
        raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    return token_id_list(p)  # names ``prompt`` when it is no sequence (None, a number)
