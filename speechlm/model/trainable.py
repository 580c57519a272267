"""What trains: full, frozen or LoRA LLM, full or frozen encoder; the projector and CTC head always train.

`apply_train_modes(model, cfg)` is called once, right after `SpeechLLM` is built (before any
parallelism):

- ``model.llm.train=frozen``: every LLM parameter gets ``requires_grad=False``;
- ``model.llm.train=lora``: LoRA adapters are injected into the LLM's linear layers named by
  ``model.llm.lora.target_modules`` with ``peft.inject_adapter_in_model``, and only the adapters train.
  The LLM stays the plain transformers model (no ``PeftModel`` wrapper): its forward, the extra
  keyword arguments our attention backends read (``cu_seq_lens_q``, ``varlen_meta``, ``cp_context``,
  ``logits_to_keep``), ``get_input_embeddings`` and the decoder-layer paths FSDP2 shards by are all
  unchanged. Only each adapted ``nn.Linear`` becomes a peft ``lora.Linear`` around it (its weight is
  then ``<path>.base_layer.weight``): q/k/v are the base projection plus the adapter's, computed before
  the attention backend sees them, so every backend and CP attention get them as they are;
- ``model.encoder.train=frozen``: every encoder parameter gets ``requires_grad=False`` and the training
  step runs the encoder without autograd (`speechlm.train.schedule.encoder_runs_frozen`).

The optimizer holds the parameters that require gradients only (`speechlm.train.schedule`), so a
frozen parameter has no optimizer state; under FSDP2 a parameter without a gradient is not
reduce-scattered. What was frozen is recorded on the model as `TrainModes`: the frozen parameters'
names (checkpoints leave them out, `trainable_state_dict`) and a fingerprint per frozen part, a SHA-256
over the frozen tensors (names without peft's ``.base_layer``, dtypes, shapes, bytes), which a
checkpoint stores and resume compares (`speechlm.use.checkpoint_files.check_frozen_base`).

Tokens the run added to a pretrained LLM's vocabulary (`speechlm.model.llm.init_added_rows`: the
language tags of ``data.lang_tags=special``) start with embedding and LM-head rows at the mean of the
pretrained ones, all equal. A frozen or LoRA LLM would keep them so, and could never tell the languages
apart; with ``model.llm.train_added_rows`` (the default) those rows train anyway, as `AddedTokenRows`:
a small module on the `SpeechLLM` holding one trainable row per added token (the audio placeholder
excepted: it is never read, packing replaces it, nor predicted), initialised from the frozen matrices
and applied by forward hooks on the LLM's input embedding (its output rows for those ids are replaced)
and on its LM head (its logits for those ids are recomputed from the trained rows). A tied matrix gets
one row set for both. The frozen matrices are never written, so the base fingerprint holds; the rows
are trained parameters, in the checkpoint and the optimizer like the projector's.

`merge_lora(llm)` folds the adapters and the trained added rows into the base weights and removes
peft's wrappers and the rows' hooks: a plain transformers model for ``save_pretrained``.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speechlm.config import LoRAConfig, ModelConfig
from speechlm.errors import UsageError
from speechlm.model.llm_preflight import lora_target_problem

LORA_MARK = "lora_"  # peft's adapter parameters: lora_A / lora_B (and lora_embedding_* for embeddings)
BASE_LAYER = ".base_layer"  # peft's wrapped module inside each adapted layer


@dataclass(frozen=True)
class TrainModes:
    """What `apply_train_modes` did: the modes, the frozen parameters' names (relative to the
    `SpeechLLM`, tied duplicates included) and a fingerprint per frozen part ("llm", "encoder")."""

    llm: str = "full"
    encoder: str = "full"
    frozen: frozenset[str] = frozenset()
    fingerprints: dict[str, str] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        """Plain values for a checkpoint's meta.pt (loaded with weights_only=True)."""
        return {"llm": self.llm, "encoder": self.encoder, "fingerprints": dict(self.fingerprints)}


def train_modes_of(model: Any) -> TrainModes:
    """The `TrainModes` of a `SpeechLLM` (everything trains when `apply_train_modes` was not called)."""
    modes = getattr(model, "train_modes", None)
    return modes if isinstance(modes, TrainModes) else TrainModes()


def inject_lora(llm: nn.Module, lora: LoRAConfig) -> None:
    """Inject LoRA adapters in place (peft, no wrapper); a target that matches no module is an error."""
    from peft import LoraConfig, inject_adapter_in_model  # lazy: peft (optional, speechlm[pretrained])

    problem = lora_target_problem(list(lora.target_modules), llm)
    if problem:  # the pre-flight refuses it first (`check_pretrained_llm`); a direct caller gets it here
        raise UsageError(problem)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    inject_adapter_in_model(config, llm)
    if hasattr(llm, "peft_config"):  # peft copies its config onto the model; ours is the run's config
        del llm.peft_config


def is_lora_name(name: str) -> bool:
    return any(part.startswith(LORA_MARK) for part in name.split("."))


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over (name without ``.base_layer``, dtype, shape, bytes) of each tensor, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(((n.replace(BASE_LAYER, ""), t) for n, t in named), key=lambda x: x[0]):
        data = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{data.dtype}|{tuple(data.shape)}\n".encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _freeze(module: nn.Module, prefix: str, keep: Any = lambda name: False) -> list[tuple[str, torch.Tensor]]:
    frozen: list[tuple[str, torch.Tensor]] = []
    for name, p in module.named_parameters(remove_duplicate=False):  # tied weights under both names
        if keep(name):
            p.requires_grad_(True)
            continue
        p.requires_grad_(False)
        frozen.append((f"{prefix}{name}", p))
    return frozen


class _RowsHook:
    """A forward hook of `AddedTokenRows` (a class, so that `merge_lora` can find and remove it)."""

    def __init__(self, rows: AddedTokenRows, side: str) -> None:
        self.rows, self.side = rows, side

    def __call__(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return self.rows.embed(args[0], out) if self.side == "in" else self.rows.logits(args[0], out)


class AddedTokenRows(nn.Module):
    """Trainable embedding (``emb``) and LM-head (``head``; None when tied) rows of ``ids``, over a
    frozen LLM; ``slot`` maps a vocabulary id to its row (-1: not added)."""

    ids: torch.Tensor
    slot: torch.Tensor

    def __init__(self, llm: Any, ids: Iterable[int]) -> None:
        super().__init__()
        ids = sorted({int(i) for i in ids})
        emb_w = llm.get_input_embeddings().weight
        head = llm.get_output_embeddings()
        index = torch.tensor(ids, dtype=torch.long)
        self.emb = nn.Parameter(emb_w.detach()[index].clone().float())
        self.tied = head is None or head.weight is emb_w
        self.head = None if self.tied else nn.Parameter(head.weight.detach()[index].clone().float())
        self.register_buffer("ids", index, persistent=False)
        slot = torch.full((emb_w.shape[0],), -1, dtype=torch.long)
        slot[index] = torch.arange(len(ids))
        self.register_buffer("slot", slot, persistent=False)

    def embed(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        slot = self.slot.to(ids.device)[ids]
        rows = self.emb.to(out.dtype)[slot.clamp(min=0)]
        return torch.where((slot >= 0).unsqueeze(-1), rows, out)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        weight = self.emb if self.head is None else self.head
        new = nn.functional.linear(hidden, weight.to(hidden.dtype)).to(out.dtype)
        return out.index_copy(out.dim() - 1, self.ids.to(out.device), new)

    def install(self, llm: Any) -> None:
        llm.get_input_embeddings().register_forward_hook(_RowsHook(self, "in"))
        head = llm.get_output_embeddings()
        if head is not None:
            head.register_forward_hook(_RowsHook(self, "out"))


def bake_added_rows(llm: Any) -> None:
    """Write the trained rows of an `AddedTokenRows` whose hooks ``llm`` carries into its matrices and
    remove the hooks (``llm`` is then a plain model that computes the same)."""
    modules = [llm.get_input_embeddings(), llm.get_output_embeddings()]
    for module in [m for m in modules if m is not None]:
        for key, hook in list(module._forward_hooks.items()):
            if not isinstance(hook, _RowsHook):
                continue
            rows = hook.rows
            with torch.no_grad():
                if hook.side == "in":
                    module.weight[rows.ids] = rows.emb.to(module.weight.dtype)
                elif rows.head is not None:
                    module.weight[rows.ids] = rows.head.to(module.weight.dtype)
            del module._forward_hooks[key]


def apply_train_modes(model: Any, cfg: ModelConfig) -> None:
    """Freeze / inject adapters per ``model.llm.train`` and ``model.encoder.train``; record `TrainModes`
    on ``model.train_modes``. Called once, on the unsharded model (the fingerprints read whole tensors)."""
    llm_mode, enc_mode = cfg.llm.train, cfg.encoder.train
    fingerprints: dict[str, str] = {}
    frozen: list[str] = []
    if llm_mode == "lora":
        inject_lora(model.llm, cfg.llm.lora)
    if llm_mode in ("frozen", "lora"):
        part = _freeze(model.llm, "llm.", keep=is_lora_name if llm_mode == "lora" else lambda name: False)
        fingerprints["llm"] = fingerprint(part)
        frozen += [n for n, _ in part]
    added = [i for i in model.added_token_ids if i != model.audio_id]
    if llm_mode in ("frozen", "lora") and cfg.llm.train_added_rows and added:
        model.added_rows = AddedTokenRows(model.llm, added)
        model.added_rows.install(model.llm)
    if enc_mode == "frozen":
        part = _freeze(model.encoder, "encoder.")
        fingerprints["encoder"] = fingerprint(part)
        frozen += [n for n, _ in part]
    model.train_modes = TrainModes(llm_mode, enc_mode, frozenset(frozen), fingerprints)


def trainable_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the frozen parameters (buffers and trained parameters stay)."""
    frozen = train_modes_of(model).frozen
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def merge_lora(llm: nn.Module, *, inplace: bool = False) -> Any:
    """The LLM with every LoRA adapter merged into its base weight and peft's wrappers removed: a plain
    transformers model (``save_pretrained`` writes the base architecture's keys). Works on an unsharded
    model; ``inplace=False`` leaves ``llm`` as it is."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: peft (optional)

    out = llm if inplace else copy.deepcopy(llm)
    for name, module in list(out.named_modules()):
        if not isinstance(module, BaseTunerLayer):
            continue
        module.merge()
        parent_name, _, attr = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        setattr(parent, attr, module.get_base_layer())
    bake_added_rows(out)
    if hasattr(out, "peft_config"):
        del out.peft_config
    for p in out.parameters():
        p.requires_grad_(True)
    return out
