"""Bridge: everything one HF architecture needs to become a Megatron GPTModel and back.

A family file subclasses :class:`Bridge` and states data: the architecture name, config-field tables, flags and,
where its checkpoints differ, extra mappings. The base derives the Megatron ``TransformerConfig`` from
``config.json`` (never from shell flags), builds the model chunks of this rank, and lists the parameter
mappings that :mod:`converters.stream` uses in both directions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from compat.megatron_core import expert_biases, sinks_split_by_head
from compat.megatron_core.cpu import loaded_later
from converters.mapping import QKV, Direct, GatedMLP, Mapping, Vocab
from converters.stacks import ExpertStacks
from parallel.config import ParallelConfig
from parallel.device import Device

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

# (HF config.json key, TransformerConfig attribute): read one way on load, the other way on export.
# Every family's decoder fields; DENSE_CONFIG adds grouped-query attention's (MLA families add their own).
DECODER_CONFIG: tuple[tuple[str, str], ...] = (
    ("num_hidden_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("intermediate_size", "ffn_hidden_size"),
    ("rms_norm_eps", "layernorm_epsilon"),
    ("initializer_range", "init_method_std"),
)
DENSE_CONFIG = DECODER_CONFIG + (("num_key_value_heads", "num_query_groups"), ("head_dim", "kv_channels"))

# HF YaRN parameter -> Megatron-Core's field: MLATransformerConfig's as named, GPTModel's (gpt_oss.yarn_config) with a
# ``yarn_`` prefix.
YARN = (
    ("factor", "rotary_scaling_factor"),
    ("original_max_position_embeddings", "original_max_position_embeddings"),
    ("beta_fast", "beta_fast"),
    ("beta_slow", "beta_slow"),
    ("mscale", "mscale"),
    ("mscale_all_dim", "mscale_all_dim"),
)

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


# TransformerConfig fields for a model whose every parameter a load fills right after it is built (the roles': an HF
# load first checks that the checkpoint covers each one, converters.mapping.check_tensors, and a Megatron
# checkpoint's fails on one it lacks; LoRA adapters and value heads initialise themselves). Megatron's random init is
# then work thrown away: on CPU every rank drew each layer's full fp32 master weight and copied its shard (SmolLM2:
# 1 s of a rank's CPU for normal_ alone), which compat.megatron_core.cpu spares for these weights.
INIT_SKIPPED = dict(init_method=loaded_later, output_layer_init_method=loaded_later, embedding_init_method=loaded_later)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Megatron's vocabulary size under TP: rounded up so every TP rank holds a multiple of 128 rows."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


_L = "decoder.layers.*."
_HL = "model.layers.*."
_E = _L + "mlp.experts.local_experts.*."
_HE = _HL + "mlp.experts.*."

# A routed MoE's router and gated experts, named alike by every MoE family's checkpoints.
ROUTED_EXPERTS: tuple[Mapping, ...] = (
    Direct(_L + "mlp.router.weight", _HL + "mlp.gate.weight"),
    GatedMLP(_E + "linear_fc1.weight", (_HE + "gate_proj.weight", _HE + "up_proj.weight")),
    Direct(_E + "linear_fc2.weight", _HE + "down_proj.weight", tp_axis=1),
)


class Bridge:
    """Base for a Llama-style decoder; subclasses adjust the class attributes below."""

    architecture: ClassVar[str]
    model_type: ClassVar[str]
    # transformers' model type of the same layers, where the family has none of its own (Kimi-K2's are DeepSeek-V3's)
    transformers_model_type: ClassVar[str | None] = None
    mla: ClassVar[bool] = False  # multi-latent attention (Megatron's MLATransformerConfig)
    config_table: ClassVar[tuple[tuple[str, str], ...]] = DENSE_CONFIG
    qk_norm: ClassVar[bool] = False
    rope_types: ClassVar[tuple[str, ...]] = ("default",)
    # None: read HF's ``attention_bias``; a bool: the family's fixed choice (Qwen2 always has q/k/v biases).
    qkv_bias: ClassVar[bool | None] = None
    # config.json keys that another transformers version writes under another name -> this family's name.
    config_aliases: ClassVar[dict[str, str]] = {}
    # The family's reward-model architecture (a scalar ``score`` head instead of the LM head): a checkpoint a
    # critic can start from. None: the family has none.
    value_architecture: ClassVar[str | None] = None

    def __init__(self, hf_config: dict):
        self.hf = dict(hf_config)
        # A reward model's checkpoint: its score head becomes the critic's value head.
        architecture = (self.hf.get("architectures") or [None])[0]
        self.value_model = self.value_architecture is not None and architecture == self.value_architecture
        labels = len(self.hf.get("id2label") or {0: None})
        if self.value_model and labels != 1:
            raise ValueError(f"{self.value_architecture} with {labels} labels: a value head has one (num_labels: 1)")
        for alias, key in self.config_aliases.items():
            if key not in self.hf and alias in self.hf:
                self.hf[key] = self.hf.pop(alias)
        self.hf.setdefault("head_dim", self.hf["hidden_size"] // self.hf["num_attention_heads"])
        self.hf.setdefault("num_key_value_heads", self.hf["num_attention_heads"])
        self.check_supported()

    # ---- config translation -------------------------------------------------------------------------------
    def check_supported(self) -> None:
        """Refuse HF features this bridge does not translate, instead of silently building another model."""
        act = self.hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{self.architecture}: hidden_act={act!r} is not supported (expected 'silu')")
        if self.rope_type not in self.rope_types:
            raise ValueError(
                f"{self.architecture}: rope scaling type {self.rope_type!r} is not supported "
                f"(supported: {list(self.rope_types)})"
            )

    @property
    def rope_scaling(self) -> dict:
        """RoPE parameters: ``rope_scaling`` in released config.json files, ``rope_parameters`` in transformers 5."""
        return self.hf.get("rope_scaling") or self.hf.get("rope_parameters") or {}

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def vocab_size(self) -> int:
        return self.hf["vocab_size"]

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.hf.get("tie_word_embeddings", False))

    @property
    def rope_theta(self) -> float:
        return float(self.hf.get("rope_theta") or self.rope_scaling.get("rope_theta", 10000.0))

    @property
    def rotary_percent(self) -> float:
        """The share of each head's dimensions RoPE rotates (the first ones; GLM-4.5 rotates half)."""
        return float(self.rope_scaling.get("partial_rotary_factor", self.hf.get("partial_rotary_factor", 1.0)))

    @property
    def attention_bias(self) -> bool:
        return bool(self.hf.get("attention_bias", False)) if self.qkv_bias is None else self.qkv_bias

    @property
    def num_experts(self) -> int | None:
        return None

    @property
    def num_mtp_layers(self) -> int:
        """Multi-token-prediction layers of the checkpoint (:mod:`models.mtp`); families with none say 0."""
        return 0

    @property
    def multi_latent_attention(self) -> bool:
        return self.mla

    @property
    def sliding_window(self) -> bool:
        """Whether some layers attend within a sliding window (their masks are bands: no shared-prompt rows)."""
        return False

    @property
    def linear_attention(self) -> bool:
        """Whether some layers are linear attention (a recurrence over the whole row: no masks, no shared prompts)."""
        return False

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab(self.vocab_size, tp)

    def validate_layout(self, parallel: ParallelConfig) -> None:
        parallel.validate_model(
            num_layers=self.hf["num_hidden_layers"],
            num_attention_heads=self.hf["num_attention_heads"],
            num_query_groups=self.hf["num_key_value_heads"],
            vocab_size=self.vocab_size,
            num_experts=self.num_experts,
        )

    def transformer_config(
        self, parallel: ParallelConfig, *, params_dtype: torch.dtype | None = None, **overrides
    ) -> TransformerConfig:
        """Megatron config for this model under ``parallel``; ``overrides`` set further TransformerConfig fields.

        ``params_dtype`` defaults to this machine's (:attr:`parallel.device.Device.params_dtype`).
        """
        self.validate_layout(parallel)
        device = Device.current()
        if params_dtype is None:
            params_dtype = device.params_dtype
        interleaved = parallel.vpp > 1
        fields = {mcore: self.hf[key] for key, mcore in self.config_table if key in self.hf}
        fields.update(
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.attention_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            use_cpu_initialization=device.cpu_initialization,
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            virtual_pipeline_model_parallel_size=parallel.vpp if interleaved else None,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.expert_tp,
            sequence_parallel=parallel.sequence_parallel,
            num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
            num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
            # Interleaved PP=2 with batched p2p swaps the two directions' messages between the same pair of
            # ranks (wrong losses on gloo); separate, overlapped send/recv is exact (tests/distributed).
            overlap_p2p_comm=interleaved,
            batch_p2p_comm=not interleaved,
            # megatron-core 0.16.1's default ("full") is deprecated by itself, with a warning on every config; the
            # empty list is what it turns "full" into.
            cuda_graph_scope=[],
            mtp_num_layers=self.num_mtp_layers or None,
        )
        fields.update(self.extra_config())
        fields.update(overrides)
        return self.config_class()(**fields)

    def config_class(self) -> type[TransformerConfig]:
        """The TransformerConfig class this family's fields fill."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

        return MLATransformerConfig if self.mla else TransformerConfig

    @property
    def position_embedding_type(self) -> str:
        """GPTModel's ``position_embedding_type``: RoPE, or YaRN where the family builds it into the layers."""
        return "rope"

    def extra_config(self) -> dict:
        """Family-specific TransformerConfig fields (MoE, ...)."""
        return {}

    def hf_config(self, config: TransformerConfig) -> dict:
        """config.json for a model with Megatron ``config``: this bridge's HF config with the mapped fields."""
        out = dict(self.hf)
        out.update({key: getattr(config, mcore) for key, mcore in self.config_table})
        architecture = self.value_architecture if self.value_model else self.architecture
        out.update(architectures=[architecture], model_type=self.model_type)
        return out

    # ---- model --------------------------------------------------------------------------------------------
    def build_model(
        self,
        config: TransformerConfig,
        *,
        backend: str = "auto",
        max_sequence_length: int | None = None,
        meta: bool = False,
        padded_vocab_size: int | None = None,
    ) -> list[GPTModel]:
        """This rank's model chunks (one per virtual pipeline stage), on the current device, weights initialised (a
        reward model's with a value head for its LM head);
        ``meta``: on the meta device instead (shapes without memory, for full-size dry runs);
        ``padded_vocab_size``: instead of this layout's padding (a checkpoint converted for another TP size)."""
        from megatron.core import parallel_state

        from models.value_head import attach_value_heads

        machine = Device.current()
        backend = machine.layer_backend(backend)
        vocab = padded_vocab_size or self.padded_vocab_size(parallel_state.get_tensor_model_parallel_world_size())
        vpp = config.virtual_pipeline_model_parallel_size or 1
        device = torch.device("meta") if meta else machine.torch_device()
        chunks = []
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            with device if meta else contextlib.nullcontext():
                model = self._gpt_model(config, backend, vp_stage, vocab, max_sequence_length)
            chunks.append(model.to(device=device, dtype=config.params_dtype))
        sinks_split_by_head(chunks)
        expert_biases(chunks)
        if self.value_model:  # a reward model's score head in place of the LM head
            attach_value_heads(chunks, parallel_state.get_tensor_model_parallel_group())
        return chunks

    def _gpt_model(self, config, backend, vp_stage, vocab_size, max_sequence_length) -> GPTModel:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        from models.mtp import MTPModel
        from models.spec import block_spec, mtp_block_spec

        model = MTPModel if config.mtp_num_layers else GPTModel
        return model(
            config=config,
            transformer_layer_spec=block_spec(config, backend, vp_stage),
            mtp_block_spec=mtp_block_spec(config, backend, vp_stage),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length or self.hf.get("max_position_embeddings", 4096),
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=self.tie_word_embeddings,
            position_embedding_type=self.position_embedding_type,
            rotary_percent=self.rotary_percent,
            rotary_base=self.rope_theta,
            vp_stage=vp_stage,
        )

    # ---- parameter mappings -------------------------------------------------------------------------------
    def mappings(self) -> list[Mapping]:
        layer = [
            Direct(_L + "input_layernorm.weight", _HL + "input_layernorm.weight"),
            Direct(_L + "self_attention.linear_proj.weight", _HL + "self_attn.o_proj.weight", tp_axis=1),
            *self.attention_mappings(),
            *self.mlp_mappings(),
            # TransformerEngine fuses the pre-MLP norm into the following linear layer.
            Direct(_L + "mlp.linear_fc1.layer_norm_weight", _HL + "post_attention_layernorm.weight"),
        ]
        # An MTP layer's copies of the shared embedding and head (see mtp_mappings).
        mtp = [self.mtp_prefix(i) for i in range(self.num_mtp_layers)]
        embeddings = ("model.embed_tokens.weight", *(p + "embed_tokens.weight" for p in mtp))
        heads = tuple(p + "shared_head.head.weight" for p in mtp)
        tied = self.tie_word_embeddings
        out = [
            Vocab("embedding.word_embeddings.weight", embeddings + (heads if tied else ()), vocab_size=self.vocab_size),
            Direct("decoder.final_layernorm.weight", "model.norm.weight"),
            *layer,
            *self.mtp_mappings(layer),
        ]
        # A tied output layer (last pipeline stage's copy of the embedding) is loaded from the embedding and
        # never exported: HF checkpoints of tied models have no lm_head.
        if self.value_model:  # the critic's value head (models/value_head.py), replicated over TP
            return [*out, Direct("output_layer.weight", "score.weight")]
        head = ("model.embed_tokens.weight",) if tied else ("lm_head.weight", *heads)
        out.append(Vocab("output_layer.weight", head, vocab_size=self.vocab_size, export=not tied))
        return out

    def expert_stacks(self) -> ExpertStacks | None:
        """Where the family's checkpoints stack each layer's experts into one tensor (:mod:`converters.stacks`)."""
        return None

    def mtp_prefix(self, i: int) -> str:
        """HF name prefix of MTP layer ``i``: after the decoder's layers (DeepSeek-V3's layout)."""
        return f"model.layers.{self.hf['num_hidden_layers'] + i}."

    def is_mtp_tensor(self, hf_name: str) -> bool:
        """Whether checkpoint tensor ``hf_name`` belongs to an MTP layer."""
        return any(hf_name.startswith(self.mtp_prefix(i)) for i in range(self.num_mtp_layers))

    def mtp_own_tensors(self) -> dict[str, torch.Size]:
        """Shapes of the MTP layers' checkpoint tensors besides their decoder layers (:meth:`mtp_mappings`)."""
        h, v, out = self.hf["hidden_size"], self.vocab_size, {}
        for i in range(self.num_mtp_layers):
            p = self.mtp_prefix(i)
            shapes = {"enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h), "shared_head.norm": (h,)}
            shapes |= {"embed_tokens": (v, h), "shared_head.head": (v, h)}
            out |= {f"{p}{name}.weight": torch.Size(shape) for name, shape in shapes.items()}
        return out

    def mtp_mappings(self, layer: list[Mapping]) -> list[Mapping]:
        """Megatron's MTP layer i: its norms of the embedding and the hidden state, their projection, a decoder layer
        (named as the decoder's, ``layer``) and the norm before the shared head. Megatron's MTP uses the model's
        embedding and output layer; the checkpoint holds copies of them per MTP layer (``embed_tokens``,
        ``shared_head.head``), which :class:`converters.mapping.Vocab` loads only when equal and exports to each."""
        out = []
        for i in range(self.num_mtp_layers):
            hf, mg = self.mtp_prefix(i), f"mtp.layers.{i}."
            out += [
                Direct(mg + "enorm.weight", hf + "enorm.weight"),
                Direct(mg + "hnorm.weight", hf + "hnorm.weight"),
                Direct(mg + "eh_proj.weight", hf + "eh_proj.weight", tp_axis=0),
                Direct(mg + "final_layernorm.weight", hf + "shared_head.norm.weight"),
            ]
            out += [
                dataclasses.replace(
                    m,
                    megatron=m.megatron.replace(_L, mg + "transformer_layer.", 1),
                    hf=tuple(h.replace(_HL, hf, 1) for h in m.hf),
                )
                for m in layer
            ]
        return out

    def attention_mappings(self) -> list[Mapping]:
        """Grouped-query attention: fused q/k/v (weights, optional biases) and optional q/k norms."""
        out = [
            self._qkv_mapping("weight"),
            # TransformerEngine fuses the pre-attention norm into linear_qkv.
            Direct(_L + "self_attention.linear_qkv.layer_norm_weight", _HL + "input_layernorm.weight"),
        ]
        if self.attention_bias:
            out.append(self._qkv_mapping("bias"))
        if self.qk_norm:
            out += [
                Direct(_L + "self_attention.q_layernorm.weight", _HL + "self_attn.q_norm.weight"),
                Direct(_L + "self_attention.k_layernorm.weight", _HL + "self_attn.k_norm.weight"),
            ]
        return out

    def _qkv_mapping(self, kind: str) -> Mapping:
        return QKV(
            _L + f"self_attention.linear_qkv.{kind}",
            tuple(_HL + f"self_attn.{p}_proj.{kind}" for p in "qkv"),
            num_attention_heads=self.hf["num_attention_heads"],
            num_query_groups=self.hf["num_key_value_heads"],
            head_dim=self.hf["head_dim"],
        )

    def mlp_mappings(self) -> list[Mapping]:
        """Dense gated MLP; MoE families replace this."""
        return [
            Direct(_L + "pre_mlp_layernorm.weight", _HL + "post_attention_layernorm.weight"),
            GatedMLP(_L + "mlp.linear_fc1.weight", (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight")),
            Direct(_L + "mlp.linear_fc2.weight", _HL + "mlp.down_proj.weight", tp_axis=1),
        ]

    def ignored_hf_tensors(self) -> list[str]:
        """Regexes of checkpoint tensors that have no Megatron parameter on purpose."""
        ignored = [r"rotary_emb\.inv_freq$"]
        if self.tie_word_embeddings:
            ignored.append(r"^lm_head\.weight$")
        return ignored

    @functools.cached_property
    def _ignored(self) -> list[re.Pattern]:
        return [re.compile(p) for p in self.ignored_hf_tensors()]

    def ignores(self, hf_name: str) -> bool:
        """Whether checkpoint tensor ``hf_name`` has no Megatron parameter on purpose (see ignored_hf_tensors)."""
        return any(rx.search(hf_name) for rx in self._ignored)

    # ---- rollout engine -----------------------------------------------------------------------------------
    def engine_problem(self, cuda: bool, dtype: str) -> str | None:
        """Why a rollout engine of ``dtype`` cannot serve this model on this platform (an engine's measured limits),
        or None."""
        return None

    def engine_tolerance(self, cuda: bool, dtype: torch.dtype) -> tuple[float, float] | None:
        """(max, mean) |Δ| of log-probs the post-sync probe allows this model's engine of ``dtype`` here, where its
        kernels are measured further from the trainer than the dtype's default; None: the default."""
        return None

    def rollout_engine_args(self, cuda: bool) -> dict:
        """Extra ``vllm.LLM`` arguments this model needs on the engine's platform (workarounds for measured
        engine bugs; none by default)."""
        return {}
