"""Where one MoE layer's tensors live, per naming scheme.

Two expert layouts are read for every supported model_type:

- classic, per expert (what Hub checkpoints and `save_pretrained` write by default):
  `<block>.experts.<e>.<gate>.weight` [I, H], `<up>` [I, H], `<down>` [H, I], where <block> is
  `model.layers.<i>.block_sparse_moe` (Mixtral) or `model.layers.<i>.mlp`, and the projections
  are w1/w3/w2 (Mixtral) or gate_proj/up_proj/down_proj. Quantized variants keep these names and
  add companions (see matrices.py).
- fused, stacked over experts (transformers >= 5 in memory, `save_pretrained(...,
  save_original_format=False)`): `<block>.experts.gate_up_proj` [E, 2I, H] (gate rows, then up)
  and `<block>.experts.down_proj` [E, H, I]; the transposed orientation [E, H, 2I] / [E, I, H] is
  also read. Orientation is decided from both shapes together, which is never ambiguous
  (2I == H and I == H cannot both hold). Fused tensors must be bf16/fp16/fp32.
- fused per expert: `<block>.experts.<e>.gate_up_proj.weight` [2I, H] (gate rows, then up) and
  `<block>.experts.<e>.down_proj.weight`, in any format (an NVFP4 gate_up may carry one
  weight_scale_2 per half).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.checkpoint.files import TensorFiles
from tierstore.checkpoint.matrices import FloatMatrix, SourceMatrix, StackedRows, matrix_at
from tierstore.errors import CheckpointError
from tierstore.geometry import MoEGeometry

PROJECTIONS = {"mixtral": ("w1", "w3", "w2")}  # (gate, up, down); every other family:
DEFAULT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
BLOCK_NAMES = {"mixtral": ("block_sparse_moe", "mlp")}  # fused Mixtral saves rename it to mlp
SHARED_NAMES = {"qwen2_moe": "shared_expert", "deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts"}


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert: w13 [2I, H] (gate rows [0, I), up rows [I, 2I)) and w2 [H, I]."""

    expert: int
    w13: SourceMatrix
    w2: SourceMatrix


@dataclass(frozen=True)
class SharedExperts:
    """The dense shared MLP (DeepSeek fuses its n shared experts into one), w13 [2S, H], w2 [H, S].

    `gate_name` names Qwen2-MoE's sigmoid gate weight [1, H] (None where the model has none).
    """

    w13: SourceMatrix
    w2: SourceMatrix
    gate_name: str | None


def classic_expert_prefixes(model_type: str, decoder_layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor prefixes of one expert in the classic layout (append ".weight")."""
    block = BLOCK_NAMES.get(model_type, ("mlp",))[0]
    gate, up, down = PROJECTIONS.get(model_type, DEFAULT_PROJECTIONS)
    base = f"model.layers.{decoder_layer}.{block}.experts.{expert}"
    return f"{base}.{gate}", f"{base}.{up}", f"{base}.{down}"


class LayerLayout:
    """Resolves the tensor names of decoder layer `decoder_layer` and builds its SourceMatrix objects."""

    def __init__(self, files: TensorFiles, model_type: str, decoder_layer: int, geometry: MoEGeometry,
                 fp8_block: tuple[int, int]):
        self.files, self.model_type, self.geometry, self.fp8_block = files, model_type, geometry, fp8_block
        candidates = [f"model.layers.{decoder_layer}.{b}" for b in BLOCK_NAMES.get(model_type, ("mlp",))]
        found = [c for c in candidates if files.has(f"{c}.gate.weight")]
        if not found:
            raise CheckpointError(f"router tensor {candidates[0]}.gate.weight not found in {files.where()}")
        self.block = found[0]
        self.router_name = f"{self.block}.gate.weight"
        bias = f"{self.block}.gate.e_score_correction_bias"
        self.router_bias_name = bias if files.has(bias) else None
        expected = (geometry.num_experts, geometry.hidden)
        if files.shape(self.router_name) != expected:
            raise CheckpointError(f"tensor {self.router_name!r} in {files.file_of(self.router_name)} has shape "
                                  f"{list(files.shape(self.router_name))}, expected {list(expected)}")

    def experts(self) -> tuple[ExpertWeights, ...]:
        if self.files.has(f"{self.block}.experts.gate_up_proj"):
            return self._fused_experts()
        if self.files.has(f"{self.block}.experts.0.gate_up_proj.weight"):
            return tuple(self._fused_expert(e) for e in range(self.geometry.num_experts))
        gate, up, down = PROJECTIONS.get(self.model_type, DEFAULT_PROJECTIONS)
        return tuple(self._mlp(f"{self.block}.experts.{e}", (gate, up, down), self.geometry.expert_inter, e)
                     for e in range(self.geometry.num_experts))

    def _mlp(self, base: str, projections: tuple[str, str, str], inter: int, expert: int) -> ExpertWeights:
        hidden = self.geometry.hidden
        gate, up, down = (f"{base}.{p}" for p in projections)
        for prefix in (gate, up, down):
            if not self.files.has(f"{prefix}.weight"):
                raise CheckpointError(f"tensor {prefix}.weight not found in {self.files.where()}")
        w13 = StackedRows((self._matrix(gate, (inter, hidden)), self._matrix(up, (inter, hidden))))
        return ExpertWeights(expert, w13, self._matrix(down, (hidden, inter)))

    def _fused_expert(self, expert: int) -> ExpertWeights:
        base, inter, hidden = f"{self.block}.experts.{expert}", self.geometry.expert_inter, self.geometry.hidden
        for prefix in (f"{base}.gate_up_proj", f"{base}.down_proj"):
            if not self.files.has(f"{prefix}.weight"):
                raise CheckpointError(f"tensor {prefix}.weight not found in {self.files.where()}")
        return ExpertWeights(expert, self._matrix(f"{base}.gate_up_proj", (2 * inter, hidden)),
                             self._matrix(f"{base}.down_proj", (hidden, inter)))

    def _matrix(self, prefix: str, shape: tuple[int, int]) -> SourceMatrix:
        return matrix_at(self.files, prefix, shape, self.fp8_block)

    def _fused_experts(self) -> tuple[ExpertWeights, ...]:
        g = self.geometry
        gate_up, down = f"{self.block}.experts.gate_up_proj", f"{self.block}.experts.down_proj"
        e, i, h = g.num_experts, g.expert_inter, g.hidden
        shapes = (self.files.shape(gate_up), self.files.shape(down))
        if shapes == ((e, 2 * i, h), (e, h, i)):
            transposed = False
        elif shapes == ((e, h, 2 * i), (e, i, h)):
            transposed = True
        else:
            raise CheckpointError(
                f"fused experts {gate_up!r} {list(shapes[0])} and {down!r} {list(shapes[1])} in "
                f"{self.files.file_of(gate_up)} match neither [E, 2I, H] + [E, H, I] nor [E, H, 2I] + [E, I, H] "
                f"for E={e}, I={i}, H={h}")
        return tuple(ExpertWeights(x, FloatMatrix(self.files, gate_up, (2 * i, h), x, transposed),
                                   FloatMatrix(self.files, down, (h, i), x, transposed))
                     for x in range(e))

    def shared(self) -> SharedExperts | None:
        name = SHARED_NAMES.get(self.model_type)
        if name is None or not self.geometry.num_shared_experts:
            return None
        mlp = self._mlp(f"{self.block}.{name}", DEFAULT_PROJECTIONS, self.geometry.shared_inter, 0)
        gate = f"{self.block}.shared_expert_gate.weight" if self.model_type == "qwen2_moe" else None
        if gate is not None and not self.files.has(gate):
            raise CheckpointError(f"tensor {gate} not found in {self.files.where()}")
        return SharedExperts(mlp.w13, mlp.w2, gate)
