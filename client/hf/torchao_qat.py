"""TRACE in torchao's QAT flow: a model prepared for NVFP4 QAT with torchao switches to TRACE in one line.

torchao (0.18) prepares NVFP4 QAT by swapping each ``nn.Linear`` for ``NVFP4FakeQuantizedLinear``,
configured by an activation and a weight ``NVFP4FakeQuantizeConfig``; its prepare step hard-wires
that module (the activation fake-quantizer is not a pluggable object there), and its forward runs
the NVFP4 matmul through ``torch._scaled_mm``, which needs a Blackwell GPU (on the CPU it raises
"Invalid scaling configuration"). :class:`TraceQATConfig` is a torchao workflow config for the same
``quantize_`` call::

    quantize_(model, QATConfig(activation_config=NVFP4FakeQuantizeConfig(),
                               weight_config=NVFP4FakeQuantizeConfig(), step="prepare"))   # torchao
    guidance = TraceGuidance(model)
    quantize_(model, TraceQATConfig(guidance))                                            # TRACE
    for step in ...:
        guidance.set(reader.read(plan))        # {site: Guidance} rows aligned to the batch's tokens
        loss = model(**batch).loss; loss.backward(); opt.step()
    quantize_(model, QATConfig(step="convert"))                                           # torchao, as before

Each prepared ``NVFP4FakeQuantizedLinear`` becomes a :class:`TraceNVFP4FakeQuantizedLinear` (a
subclass, so torchao's convert step treats it as its own) that keeps the module's weight and
configs. Its forward emulates NVFP4 in high precision, so it also runs on the CPU: the weight is
fake-quantized with torchao's own ``NVFP4Tensor`` (quantize then dequantize, its per-tensor scale
when the weight config asks for one), and the input activation is rounded with TRACE
(:func:`tracestore.guided.guided_round` on the CPU, :func:`tracestore.kernels.guided_fp4`'s CUDA
kernel when the input is on a GPU; straight-through backward) toward the rollout's recorded
codes when the module's input is a recorded site that has guidance for this step, with RTN for
rows without a record (numerics.md section 8: the trainer's own block scales and per-tensor scale,
``amax/2688`` as torchao's ``per_tensor_amax_to_scale``). Inputs of modules that are no recorded
site are fake-quantized with torchao's ``NVFP4Tensor`` as torchao would. The backward is what
torchao's is: gradients of ``linear(x_fq, w_fq)`` passed straight through both fake-quantizers.

Which module reads which site: a module's fully qualified name maps to a site name through
``site_of`` (default :func:`default_site_of`: the gate and up projections of a layer's MLP or
shared expert read ``layers.<L>.mlp.input``, the input of that layer's MoE block). Guidance rows
must align row for row to the module's flattened input rows (``[batch * tokens]``); a mismatch is a
:class:`~tracestore.errors.ShapeError`, never a silent misalignment.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from tracestore.errors import ConfigError, ShapeError, require
from tracestore.formats import NVFP4
from tracestore.guidance import Guidance

require("torchao", "framework")

from torchao.core.config import AOBaseConfig  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # noqa: E402
from torchao.prototype.qat import NVFP4FakeQuantizeConfig, NVFP4FakeQuantizedLinear  # noqa: E402
from torchao.quantization.transform_module import register_quantize_module_handler  # noqa: E402

_MLP_INPUT = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(?:shared_expert\.)?(?:gate_proj|up_proj)$")


def default_site_of(fqn: str) -> str | None:
    """``layers.<L>.mlp.input`` for the gate/up projections of layer L's MLP or shared expert (their
    input is the MoE block's input); None for every other module."""
    m = _MLP_INPUT.search(fqn)
    return f"layers.{m.group(1)}.mlp.input" if m else None


class TraceGuidance:
    """The guidance of the current step, per site, and which module reads which site.

    ``set(rows)`` takes ``{site: Guidance}`` (``GuidanceReader.read``) or ``{site: SiteRows}``
    (``StoreReader.read`` / ``RankPlan.read``); ``clear()`` drops it (every module then uses RTN).
    ``site_of`` maps a module's name in ``model`` to a site (default :func:`default_site_of`).
    ``rule``: TRACE's rounding rule ("bracket" or "paper").
    """

    def __init__(
        self, model: torch.nn.Module, site_of: Callable[[str], str | None] = default_site_of, rule: str = "bracket"
    ) -> None:
        self._model = weakref.ref(model)
        self.site_of = site_of
        self.rule = rule
        self._rows: dict[str, Guidance] = {}
        self._sites: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()
        self.used: dict[str, int] = {}  # site -> forwards that read it since set()

    def set(self, rows: Mapping[str, Any]) -> None:
        self._rows = {name: _as_guidance(r) for name, r in rows.items()}
        self.used = {}

    def clear(self) -> None:
        self._rows = {}
        self.used = {}

    def site(self, module: torch.nn.Module) -> str | None:
        """The site ``module`` reads (resolved by name in the model, once)."""
        if module not in self._sites:
            model = self._model()
            if model is None:
                raise ConfigError("the model this TraceGuidance was made for is gone")
            for name, m in model.named_modules():
                if m is module:
                    self._sites[module] = self.site_of(name)
                    break
            else:
                raise ConfigError(
                    f"{type(module).__name__} is not a module of the model this TraceGuidance was made for"
                )
        return self._sites[module]

    def rows(self, module: torch.nn.Module) -> tuple[str, Guidance] | None:
        site = self.site(module)
        if site is None or site not in self._rows:
            return None
        self.used[site] = self.used.get(site, 0) + 1
        return site, self._rows[site]


def _as_guidance(r: Any) -> Guidance:
    if isinstance(r, Guidance):
        return r
    # tracestore.storage.reader.SiteRows (numpy)
    site = r.site
    return Guidance(
        codes=torch.from_numpy(r.codes),
        scales=torch.from_numpy(r.scales),
        global_scale=torch.from_numpy(r.global_scale),
        bits=site.bits,
        fmt=site.fmt,
        token_scales=None if r.token_scales is None else torch.from_numpy(r.token_scales),
        valid=torch.from_numpy(r.valid),
    )


class _Straight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def torchao_nvfp4_fake_quant(x: torch.Tensor, config: NVFP4FakeQuantizeConfig) -> torch.Tensor:
    """``x`` quantized to NVFP4 with torchao's ``NVFP4Tensor`` and dequantized (2-D, last dim a
    multiple of 16), straight-through backward."""
    with torch.no_grad():
        scale = per_tensor_amax_to_scale(x.detach().abs().max()) if config.use_per_tensor_scale else None
        y = NVFP4Tensor.to_nvfp4(x.detach(), per_tensor_scale=scale).dequantize(x.dtype)
    return _Straight.apply(x, y) if x.requires_grad else y


def _guided_cuda(x2: torch.Tensor, g: Guidance, rule: str, own: torch.Tensor) -> torch.Tensor:
    """The activation path on a GPU: :func:`tracestore.kernels.guided_fp4` (the CUDA kernel, a
    custom op with a straight-through backward) with the guidance on ``x2``'s device,
    TraceGuidance's rule, and ``own`` (the trainer's per-tensor g) for rows without a record."""
    from tracestore.kernels import guided_fp4

    if g.codes.device != x2.device:
        g = g.to(x2.device, non_blocking=True)
    gs = g.global_scale
    if not isinstance(gs, torch.Tensor):
        gs = torch.full((), float(gs), dtype=torch.float32, device=x2.device)
    if g.rule != rule or gs is not g.global_scale:
        g = dataclasses.replace(g, rule=rule, global_scale=gs)  # type: ignore[arg-type]
    return guided_fp4(x2, g, fallback_global_scale=own.reshape(1))


class TraceNVFP4FakeQuantizedLinear(NVFP4FakeQuantizedLinear):
    """torchao's NVFP4 QAT linear with TRACE-guided activation rounding (module docstring)."""

    guidance: TraceGuidance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tracestore.guided import guided_round

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        found = self.guidance.rows(self)
        if found is None:
            xq = torchao_nvfp4_fake_quant(x2, self.activation_config)
        else:
            site, g = found
            if g.n_rows != x2.shape[0] or g.width != x2.shape[1]:
                raise ShapeError(
                    f"guidance for {site} has {g.n_rows} rows of width {g.width}; this linear's input has "
                    f"{x2.shape[0]} rows of width {x2.shape[1]} (rows must align to the flattened [batch * tokens])"
                )
            if g.fmt.name != "nvfp4":
                raise ConfigError(f"site {site} is recorded in {g.fmt.name}; torchao's NVFP4 QAT needs nvfp4 records")
            own = (
                per_tensor_amax_to_scale(x2.detach().abs().max()).float()
                if self.activation_config.use_per_tensor_scale
                else torch.ones((), dtype=torch.float32, device=x2.device)
            )
            if x2.is_cuda:
                xq = _guided_cuda(x2, g, self.guidance.rule, own)
            else:
                xq = guided_round(
                    x2,
                    g.codes,
                    g.scales,
                    g.global_scale,
                    g.bits,
                    NVFP4,
                    self.guidance.rule,  # type: ignore[arg-type]
                    token_scales=g.token_scales,
                    valid=g.valid,
                    fallback_global_scale=own,
                )
        wq = torchao_nvfp4_fake_quant(self.weight, self.weight_config)
        return F.linear(xq, wq, self.bias).reshape(*lead, -1)

    @classmethod
    def from_nvfp4(cls, mod: torch.nn.Linear, guidance: TraceGuidance) -> TraceNVFP4FakeQuantizedLinear:
        """From torchao's prepared module (its configs kept) or a plain ``nn.Linear`` (default
        NVFP4 configs); the weight and bias are shared, not copied."""
        act = getattr(mod, "activation_config", None) or NVFP4FakeQuantizeConfig()
        wcfg = getattr(mod, "weight_config", None) or NVFP4FakeQuantizeConfig()
        new = cls(
            mod.in_features,
            mod.out_features,
            mod.bias is not None,
            activation_config=act,
            weight_config=wcfg,
            device=mod.weight.device,
            dtype=mod.weight.dtype,
        )
        if mod.weight.device != torch.device("meta"):
            new.weight = mod.weight
            new.bias = mod.bias
        new.guidance = guidance
        return new


@dataclasses.dataclass
class TraceQATConfig(AOBaseConfig):
    """``quantize_(model, TraceQATConfig(guidance))``: every torchao ``NVFP4FakeQuantizedLinear``
    becomes a :class:`TraceNVFP4FakeQuantizedLinear` reading ``guidance``; plain ``nn.Linear``
    modules are left alone unless ``plain_linear=True`` (then they get torchao's default NVFP4
    configs too)."""

    guidance: TraceGuidance
    plain_linear: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.guidance, TraceGuidance):
            raise ConfigError(f"TraceQATConfig needs a TraceGuidance, got {type(self.guidance).__name__}")


@register_quantize_module_handler(TraceQATConfig)
def _trace_qat_transform(module: torch.nn.Module, config: TraceQATConfig) -> torch.nn.Module:
    if isinstance(module, TraceNVFP4FakeQuantizedLinear):
        module.guidance = config.guidance
        return module
    if isinstance(module, NVFP4FakeQuantizedLinear) or (config.plain_linear and type(module) is torch.nn.Linear):
        return TraceNVFP4FakeQuantizedLinear.from_nvfp4(module, config.guidance)  # type: ignore[arg-type]
    return module
