"""The decoder layers of a CPU step as one C++ op call (worker/kernels/cpu_layers.cpp, in the llm_cpu
extension of worker/kernels/cpu_ext.py).

Why: with the fused small ops and the quantized linears' fast paths, a batch-1 decode step of
SmolLM2 spends about a third of its model time outside the kernels: 9 op calls per layer from Python
(module calls, dispatch, argument checks), ~270 per step. `llm_cpu::decoder_layers` runs the same
ops in the same order from C++, so the outputs are bit-identical and that overhead goes (docs/cpu-
serving.md has the measured step times). The op also holds no GIL while it runs, so the worker's
event loop and gRPC threads run beside the step instead of between its ops.

Contract:
- `CpuLayerStack.build(model, backend, kv_caches) -> (stack | None, reason)`: a stack when `model`
  is a plain LlamaModel (not a wrapper such as tensor parallel's) and every layer is on the path
  the op takes: the "cpu" backend with its fused ops, bfloat16 activations and KV cache
  (contiguous), every q|k|v, o, gate|up and down linear an Int4Linear or Int8Linear (any of their
  CPU paths: W4A8 / W8A8 with int8 activations; torch's weight-only kernels or
  dequantize-then-GEMM with bfloat16 activations; with or without a bias) with no dense copy, no
  tensor parallel all-reduce (a LoRA wrapper, worker/lora.py, is looked through: the op serves the
  steps without an adapter row, where the wrapper adds nothing). Else None and the first reason it
  is not (the model runner logs it and keeps the Python layer loop). The modules' paths are read
  when the stack is built: built after `apply_cpu_paths`, as the model runner does.
- `stack(input_ids [T] int64, positions [T] int64, meta: AttentionMetadata, lora=None) -> hidden
  [T, C]`: what `model(input_ids, positions, kv_caches, meta, backend)` returns, bit for bit, with
  the new tokens' K/V written into the caches the same way; with `lora` (a step with LoRA rows,
  worker/lora.py `Adapters.op_inputs`), the adapters' deltas added in the op (close to the
  wrappers' float32 sums, not bit-identical). T = 0, or a backend whose fused ops were
  switched off since, goes to the Python loop. Other changes after the build (a module's path,
  its row thresholds, dense copies) are not seen: build a new stack.
Fails how: the ops' checks raise ValueError / RuntimeError (the same conditions as the Python
path's, the messages may differ).
Proven by tests/test_cpu_layers.py.
"""

from __future__ import annotations

import torch

from worker.kernels import cpu_attention, cpu_ext, cpu_fused


def _linear_parts(module) -> tuple[list[torch.Tensor] | None, str]:
    """The op's four tensors for one linear (worker/kernels/cpu_layers.cpp's contract), or None
    and why not."""
    from worker.kernels import cpu_quant
    from worker.model.quant import Int4Linear, Int8Linear

    name = type(module).__name__
    if not isinstance(module, (Int4Linear, Int8Linear)):
        return None, f"a {name} linear (the op takes the int4 / int8 modules of worker/model/quant.py)"
    if module.dense is not None:
        return None, f"{name} with a dense copy"
    b = module._buffers
    bias = b["bias"] if b["bias"] is not None else torch.empty(0, dtype=torch.bfloat16)
    if isinstance(module, Int4Linear) and module.w4a8:
        return [b["vnni_weight"], b["vnni_sz"], b["vnni_sz"].new_empty(0), bias], ""
    if isinstance(module, Int8Linear) and module.w8a8:
        return [b["vnni_weight"], b["vnni_corr"], b["scales"], bias], ""
    if isinstance(module, Int4Linear):
        meta = [module.group_size, module.dequant_min_rows, module.input_repeats]
        return [b["weight_packed"], b["scales_and_zeros"], torch.tensor(meta, dtype=torch.int64), bias], ""
    meta = [module.dequant_min_rows, cpu_quant.INT8_TILE]
    return [b["weight"], b["scales"], torch.tensor(meta, dtype=torch.int64), bias], ""


class CpuLayerStack:
    def __init__(self, model, backend, kv_caches, weights: list[torch.Tensor]):
        attn = model.layers[0].self_attn
        self.model, self.backend = model, backend
        self.kv_caches = kv_caches  # the runner's list of (K, V): the Python loop's argument
        self.k_caches = [k for k, _ in kv_caches]
        self.v_caches = [v for _, v in kv_caches]
        self.weights = weights
        self.rope = attn.rope
        self.eps = float(model.layers[0].input_layernorm.eps)
        self.scale = float(attn.scale)
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)

    @classmethod
    def build(cls, model, backend, kv_caches) -> tuple[CpuLayerStack | None, str]:
        from worker.model.llama import LlamaModel, RMSNorm

        if type(model) is not LlamaModel:  # e.g. tensor parallel's LeaderModel, whose forward does more
            return None, f"a {type(model).__name__}, not a plain LlamaModel"
        if backend.name != "cpu" or backend.fused is None or backend.rope_store_kv is None:
            return None, f"the {backend.name!r} attention backend without the fused CPU ops"
        if model.dtype != torch.bfloat16:
            return None, f"{model.dtype} activations (the int8-activation ops take bfloat16)"
        if any(k.dtype != torch.bfloat16 or not k.is_contiguous() for pair in kv_caches for k in pair):
            return None, "a KV cache that is not contiguous bfloat16"
        weights: list[torch.Tensor] = []
        eps = {float(layer.input_layernorm.eps) for layer in model.layers}
        eps |= {float(layer.post_attention_layernorm.eps) for layer in model.layers}
        if not len(model.layers):
            return None, "a model without layers"
        if len(eps) != 1:
            return None, "norms with different eps"
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.all_reduce is not None or mlp.all_reduce is not None:
                return None, "tensor parallel layers"
            # The op's order: input norm, q|k|v, o, post-attention norm, gate|up, down.
            order = (layer.input_layernorm, attn.qkv_proj, attn.o_proj)
            order += (layer.post_attention_layernorm, mlp.gate_up_proj, mlp.down_proj)
            for module in order:
                if isinstance(module, RMSNorm):
                    weights.append(module.weight)
                    continue
                parts, why = _linear_parts(getattr(module, "base", module))  # a LoraLinear's own
                if parts is None:
                    return None, why
                weights += parts
        try:
            cpu_ext.load()
        except RuntimeError as exc:
            return None, str(exc)
        return cls(model, backend, kv_caches, [w.detach() for w in weights]), ""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, lora=None) -> torch.Tensor:
        """`lora`: the step's (lora, lora_rows) from worker/lora.py `Adapters.op_inputs`, or None."""
        if (
            input_ids.shape[0] == 0
            or self.backend.fused is not cpu_fused
            or self.backend.rope_store_kv is None
        ):
            # nothing to run, or the backend's fused ops were switched off after the stack was built
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        x = self.model.embed_tokens(input_ids)  # (T, C)
        heads, kv_heads, head_dim = self.shape
        h, residual = torch.ops.llm_cpu.decoder_layers(
            x,
            positions,
            self.k_caches,
            self.v_caches,
            meta.slot_mapping.long(),
            meta.block_tables.to(torch.int32),
            meta.seq_lens.to(torch.int32),
            meta.query_start_loc.to(torch.int32),
            self.rope.cos,
            self.rope.sin,
            self.weights,
            self.eps,
            self.scale,
            heads,
            kv_heads,
            head_dim,
            cpu_attention.SDPA_MIN_QUERY_LEN,
            *(lora or ([], [])),
        )
        norm = self.model.norm
        return cpu_fused.rms_norm(h, norm.weight, norm.eps, residual)[0]  # the backend's fused norm
