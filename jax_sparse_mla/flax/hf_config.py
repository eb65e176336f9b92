"""Reading a Hugging Face `config.json` of a DeepSeek-V3.2 (`deepseek_v32`) or GLM-5 (`glm_moe_dsa`)
model into the fields of one attention layer (`MLAConfig`) and the model's indexer pattern.

Only what the attention layer and its indexer use is read; MoE, vocabulary and MTP fields are
ignored. Anything the layer cannot run (another model type, another RoPE scaling, no query LoRA,
grouped KV heads, non-interleaved MLA RoPE) raises a ValueError that names the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Union

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# The indexer's RoPE pairing when a config does not say: DeepSeek-V3.2's published config has no
# such key and its indexer pairs dims NeoX-style (vLLM PR #28968); GLM-5's configs state it.
_DEFAULT_INDEXER_ROPE_INTERLEAVE = {"deepseek_v32": False}

HFConfig = Union[str, "os.PathLike[str]", Mapping[str, Any]]


def load(config: HFConfig) -> dict[str, Any]:
    """The config as a dict: `config` is a path to a config.json (or to the folder holding one) or
    the parsed mapping itself."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config must be a config.json path or a mapping, got {type(config).__name__}.")
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def _field(config: Mapping[str, Any], name: str, kind: type = int) -> Any:
    if name not in config or config[name] is None:
        raise ValueError(f"the config has no {name!r}, which the attention layer needs.")
    value = config[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"config[{name!r}] must be a positive integer, got {value!r}.")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                          or value <= 0):
        raise ValueError(f"config[{name!r}] must be a positive number, got {value!r}.")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"config[{name!r}] must be true or false, got {value!r}.")
    return value


def _rope_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """MLAConfig's RoPE fields from `rope_scaling` / `rope_parameters` and `rope_theta`.

    transformers 5 writes `rope_parameters` ({"rope_type", "rope_theta", YaRN's fields}); older
    configs a top-level `rope_theta` and `rope_scaling` ({"type" or "rope_type", ...}) or none.
    """
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    if not isinstance(parameters, Mapping) or not isinstance(scaling, Mapping):
        raise ValueError("config['rope_parameters'] and config['rope_scaling'] must be objects.")
    merged = {**scaling, **parameters}
    theta = merged.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError("the config has no 'rope_theta' (top level or in 'rope_parameters').")
    fields: dict[str, Any] = {"rope_theta": float(_field({"rope_theta": theta}, "rope_theta", float))}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        fields["rope_factor"] = 1.0  # no YaRN
        return fields
    if rope_type not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"RoPE type {rope_type!r} (config 'rope_scaling' / 'rope_parameters') is "
                         "not supported: the layer applies default RoPE or DeepSeek's YaRN.")
    fields["rope_factor"] = float(_field(merged, "factor", float))
    fields["original_max_position_embeddings"] = _field(merged, "original_max_position_embeddings")
    for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", 1.0),
                          ("mscale_all_dim", 1.0)):
        fields[name] = float(merged.get(name, default) if merged.get(name) is not None else default)
    return fields


def attention_fields(config: HFConfig) -> dict[str, Any]:
    """MLAConfig's keyword arguments for the config's attention layers (see MLAConfig.from_hf_config)."""
    config = load(config)
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config['model_type'] must be one of {MODEL_TYPES}, got {model_type!r}.")
    heads = _field(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    if kv_heads != heads:
        raise ValueError(f"config['num_key_value_heads'] = {kv_heads!r}: MLA has one latent KV for "
                         f"every head, so it must equal num_attention_heads = {heads}.")
    if config.get("q_lora_rank") is None:
        raise ValueError("config['q_lora_rank'] is null: the layer needs a low-rank query projection.")
    if config.get("rope_interleave", True) is not True:
        raise ValueError("config['rope_interleave'] is false: the layer's MLA RoPE pairs dims "
                         "interleaved, as DeepSeek-V3.2 and GLM-5 do.")
    fields = dict(
        hidden_size=_field(config, "hidden_size"),
        num_heads=heads,
        q_lora_rank=_field(config, "q_lora_rank"),
        kv_lora_rank=_field(config, "kv_lora_rank"),
        qk_nope_head_dim=_field(config, "qk_nope_head_dim"),
        qk_rope_head_dim=_field(config, "qk_rope_head_dim"),
        v_head_dim=_field(config, "v_head_dim"),
        index_topk=_field(config, "index_topk"),
        index_n_heads=_field(config, "index_n_heads"),
        index_head_dim=_field(config, "index_head_dim"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
    )
    qk_head_dim = config.get("qk_head_dim")
    if qk_head_dim is not None and qk_head_dim != fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]:
        raise ValueError(f"config['qk_head_dim'] = {qk_head_dim!r} is not qk_nope_head_dim + "
                         f"qk_rope_head_dim = {fields['qk_nope_head_dim'] + fields['qk_rope_head_dim']}.")
    if "indexer_rope_interleave" in config:
        fields["indexer_rope_interleave"] = _field(config, "indexer_rope_interleave", bool)
    elif model_type in _DEFAULT_INDEXER_ROPE_INTERLEAVE:
        fields["indexer_rope_interleave"] = _DEFAULT_INDEXER_ROPE_INTERLEAVE[model_type]
    else:
        raise ValueError(f"the {model_type} config has no 'indexer_rope_interleave': the indexer's "
                         "RoPE pairing cannot be assumed.")
    fields.update(_rope_fields(config))
    return fields


def indexer_types(config: HFConfig) -> tuple[str, ...]:
    """Per layer, "full" (the layer runs its own indexer) or "shared" (it reuses the top-k of the
    layer before it), for the config's num_hidden_layers layers.

    An explicit `indexer_types` list wins; else `index_topk_freq` F (default 1) and
    `index_skip_topk_offset` O (default 2) give layer i an indexer iff max(i - O + 1, 0) % F == 0,
    the rule vLLM and SGLang apply to GLM-5.2's configs. F = 1 makes every layer full.
    """
    config = load(config)
    layers = _field(config, "num_hidden_layers")
    explicit = config.get("indexer_types")
    if explicit is not None:
        if (not isinstance(explicit, (list, tuple)) or len(explicit) != layers
                or any(t not in ("full", "shared") for t in explicit)):
            raise ValueError(f"config['indexer_types'] must list 'full' or 'shared' for each of the "
                             f"{layers} layers, got {explicit!r}.")
        types = tuple(explicit)
    else:
        freq = config.get("index_topk_freq", 1)
        offset = config.get("index_skip_topk_offset", 2)
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ValueError(f"config['index_topk_freq'] must be a positive integer, got {freq!r}.")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"config['index_skip_topk_offset'] must be a non-negative integer, "
                             f"got {offset!r}.")
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                      for i in range(layers))
    if types and types[0] != "full":
        raise ValueError("the first layer must run its own indexer (indexer type 'full'): a shared "
                         "layer reuses the top-k of the layer before it.")
    return types
