"""``load_model``: one entry point for the bundled model, GGUF files and Hugging Face folders."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedllm.model.config import ModelArchConfig
from pagedllm.model.loader.bundled import bundled_model_path
from pagedllm.model.loader.gguf_loader import load_gguf_weights
from pagedllm.model.loader.hf_loader import load_hf_weights
from pagedllm.model.loader.tokenizer import (
    chat_template_end_of_turn_ids,
    eos_token_ids,
    load_tokenizer,
)
from pagedllm.model.weight_map import checkpoint_plan

if TYPE_CHECKING:  # not at run time: see pagedllm.model.loader.tokenizer
    from transformers import PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    """A model ready to be placed on a device: the weights are loaded into host memory, whatever
    ``EngineConfig.device`` is; each worker allocates its parameters on its device and copies them
    in (``Worker``), so the loaders never touch a GPU.

    Attributes:
        config: architecture, with ``bos_token_id`` and ``eos_token_ids`` filled in.
        state_dict: Hugging Face names -> contiguous CPU tensors of the requested dtype; linears are
            ``[out_features, in_features]``, the embedding ``[vocab, hidden]``, norms ``[hidden]``.
            No ``lm_head.weight`` when ``config.tie_word_embeddings``.
        tokenizer: the model's tokenizer (with its chat template when it has one).
        source: the ``.gguf`` file or Hugging Face folder that was loaded (absolute).
        weight_bytes: bytes of ``state_dict`` (sum of ``numel * element_size``; entries on the
            meta device, projections left in GGUF blocks, count nothing).
    """

    config: ModelArchConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    source: Path
    weight_bytes: int

    @property
    def gguf_blocks_kept(self) -> bool:
        """Whether ``state_dict`` has meta entries for the projections a ``quantization="gguf"``
        worker computes from the file's blocks (``load_model(keep_gguf_blocks=True)``); other
        engines need the full expansion."""
        return any(t.is_meta for t in self.state_dict.values())

    def with_chat_template(self, template: str) -> LoadedModel:
        """A copy whose tokenizer renders chats with ``template`` (Jinja text) instead of its own;
        the template's end-of-turn special tokens join ``config.eos_token_ids``. ``self`` is left
        unchanged (tests share one loaded model), and the weights are shared, not copied."""
        tokenizer = copy.copy(self.tokenizer)
        tokenizer.chat_template = template
        eos = list(self.config.eos_token_ids)
        eos += [i for i in chat_template_end_of_turn_ids(tokenizer) if i not in eos]
        config = dataclasses.replace(self.config, eos_token_ids=eos)
        return dataclasses.replace(self, tokenizer=tokenizer, config=config)


def resolve_model_path(model: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """Decide what ``model`` designates.

    Returns:
        ``(path, kind)`` with kind ``"gguf"`` (path is the file) or ``"hf"`` (path is the folder).
        ``None`` -> the bundled SmolLM2 GGUF; a ``.gguf`` file -> it; a folder with
        ``config.json`` -> HF; a folder with exactly one ``.gguf`` file -> that file; a name that is
        no existing path but a bundled model's short name (``"gemma-3-270m"``) -> its GGUF
        (assembled into the cache on first use, see :func:`bundled_model_path`).

    Raises:
        FileNotFoundError: no such path nor bundled name (the message lists the bundled names), or
            the bundled model's package is missing (the message says how to install it).
        ValueError: a folder with neither config.json nor exactly one ``.gguf`` file; a bundled
            file whose hash does not match its package's (``BundleError``).
    """
    if model is None:
        return bundled_model_path(), "gguf"
    p = Path(model).expanduser()
    if not p.exists():
        return bundled_model_path(str(model)), "gguf"
    p = p.resolve()
    if p.is_dir():
        if (p / "config.json").is_file():
            return p, "hf"
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0], "gguf"
        if not ggufs:
            raise ValueError(f"{p} has neither a config.json nor a .gguf file")
        names = ", ".join(g.name for g in ggufs)
        raise ValueError(f"{p} holds several .gguf files ({names}); pass the file itself")
    # Any other file is tried as GGUF: a renamed file works, anything else fails with
    # "<path> is not a valid GGUF file: ...".
    return p, "gguf"


def load_model(
    model: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    keep_gguf_blocks: bool = False,
) -> LoadedModel:
    """Load config, weights and tokenizer of a supported model (``pagedllm.model.registry``).

    Args:
        model: ``None`` for the bundled SmolLM2-135M-Instruct GGUF, a bundled model's short name
            (``"smollm2-135m"``, ``"gemma-3-270m"``), a ``.gguf`` file, a folder holding exactly
            one ``.gguf`` file, or a Hugging Face folder (``config.json`` + ``*.safetensors``).
        dtype: torch.float32 (default), torch.bfloat16 or torch.float16. GGUF tensors are
            dequantized to float32 first, then cast.
        keep_gguf_blocks: for ``quantization="gguf"``: a GGUF file's natively computed
            projections are not expanded (``load_gguf_weights(keep_blocks=True)``); ignored for
            a Hugging Face folder.

    Returns:
        A :class:`LoadedModel`. ``config.eos_token_ids`` collects the tokenizer's EOS, the GGUF
        / config.json / generation_config.json EOS ids and the chat template's end-of-turn token.

    Raises:
        FileNotFoundError: the path does not exist (the message names it).
        ValueError: ``"<path> is not a valid GGUF file: ..."`` for a corrupt or truncated file;
            an unsupported architecture (names ``general.architecture`` or ``model_type``);
            an unsupported tensor type (names the tensor and type); an unsupported dtype;
            checkpoint tensors the model would not read (:func:`check_checkpoint_tensors`).
    """
    path, kind = resolve_model_path(model)
    if kind == "gguf":
        config, state = load_gguf_weights(path, dtype, keep_blocks=keep_gguf_blocks)
        check_checkpoint_tensors(config, state)
        tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
        gguf_eos = config.eos_token_ids[0] if config.eos_token_ids else None
        config.eos_token_ids = eos_token_ids(tokenizer, gguf_eos_token_id=gguf_eos)
    else:
        config, state = load_hf_weights(path, dtype)
        check_checkpoint_tensors(config, state)
        tokenizer = load_tokenizer(path)
        config.eos_token_ids = eos_token_ids(tokenizer, hf_folder=path)
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.bos_token_id = int(tokenizer.bos_token_id)
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values() if not t.is_meta)
    return LoadedModel(
        config=config, state_dict=state, tokenizer=tokenizer, source=path, weight_bytes=weight_bytes
    )


def check_checkpoint_tensors(config: ModelArchConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Check that the whole model of ``config`` reads every tensor of ``state_dict`` and finds
    every tensor it needs (``weight_map.checkpoint_plan`` on the model built on the meta device:
    no weight memory). Each worker checks again as it loads (``load_named_weights``); this runs
    first, so that a bad checkpoint fails with its own error before any tensor-parallel or
    pipeline rank starts.

    Raises:
        ValueError: naming a missing tensor, or up to five tensors no parameter reads with their
            count and the architecture ("... were not used by LlamaForCausalLM; the checkpoint
            may be a variant pagedllm does not support").
    """
    from pagedllm.attention import get_attention_backend
    from pagedllm.model.registry import model_class

    backend = get_attention_backend("torch_native", "cpu")
    with torch.device("meta"):
        model = model_class(config.architecture)(config, torch.float32, backend)
    checkpoint_plan(model, state_dict)
