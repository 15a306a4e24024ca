"""The model as a run knows it: each parameter's layer, layer type, role, shape, fans, and whether it trains.

Every plugin records this once per run, when training starts (in the run's
manifest: `run.info["model"]`), from the framework's own classes, never from
names: a BatchNorm scale is a `norm_scale` whether it is called `weight` or
`gamma`. Rules declare which roles they judge and read this structure the
same way in the training process, in `tripwire watch` and offline, so a
normalisation layer's scale is never judged as a dense kernel, a frozen
layer is visible, and a kernel whose output is normalised is known to be
free of scale. A run without it (written before it existed, or by a
plugin that cannot see a model) is judged by its collections alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .naming import is_bias, path_of

LAYER_TYPES = ("dense", "conv", "norm", "embedding", "recurrent", "attention", "other")
ROLES = ("kernel", "recurrent_kernel", "bias", "norm_scale", "norm_shift", "embedding", "other")
KERNEL_ROLES = ("kernel", "recurrent_kernel")  # the weights of a linear map: what weight rules judge
PARAMETER_COLLECTIONS = ("weights", "biases", "gradients", "updates")


@dataclass(frozen=True)
class Parameter:
    """One parameter of the model.

    path: the framework's name for it (`net.0.weight`, `sequential/dense/kernel`), the path of its tensors.
    layer: the path of the layer holding it; layer_type: one of LAYER_TYPES; layer_class: the framework's class.
    role: one of ROLES. shape: its shape. trainable: False for a frozen parameter (requires_grad False, a layer
    with trainable False, or a parameter no optimizer holds).
    fan_in: inputs each output unit of a kernel sums over (a grouped or depthwise convolution counted per group);
    fan_out: outputs per input as the framework's own initialisers count them. None where they do not apply.
    tied_to: the parameter whose storage this one shares (tied embeddings), else None.
    followed_by: the type of the layer its layer feeds in compute order ('norm' for a kernel whose output is
    normalised, so that its scale does not matter), or an activation's name; None where unknown.
    """

    path: str
    layer: str
    layer_type: str
    layer_class: str
    role: str
    shape: tuple
    trainable: bool = True
    fan_in: int | None = None
    fan_out: int | None = None
    tied_to: str | None = None
    followed_by: str | None = None

    @property
    def kernel(self) -> bool:
        return self.role in KERNEL_ROLES

    @property
    def scale_free(self) -> bool:
        """Whether the layer's output is normalised next, so that the size of this kernel does not matter."""
        return self.followed_by == "norm"

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelInfo:
    """Every parameter of a model, in the order the model registers them (about the order it computes them).

    activations: {the path of a layer whose output is captured as an activation: the path of the layer with
    parameters whose output it takes} (a ReLU module after a Linear; a Dense layer with its own activation is its
    own), so that a verdict about an activation can name the layer and the parameters behind it.
    optimizers: the class names of the optimizers that train it (`SGD`, `AdamW`), in the framework's order.
    inputs_scaled: the class of the model's first layer where it rescales or normalises the inputs itself
    (Keras' `Rescaling(1/255)` or `Normalization`, a BatchNorm first), so that their raw scale is the model's
    business; "" where it does not, or where that is not known.
    running_keep: the share of its running statistics (mean, variance) a BatchNorm layer keeps at each training
    step, the largest over the model's (Keras' `momentum`, 0.99 by default; 1 - `momentum` in torch, 0.9): an
    evaluation normalises with these statistics, which hold their initial values until enough training steps
    have replaced them; None where no layer keeps any."""

    name: str = ""
    parameters: dict = field(default_factory=dict)  # path -> Parameter
    activations: dict = field(default_factory=dict)  # activation layer path -> the layer it takes its input from
    optimizers: tuple = ()
    inputs_scaled: str = ""
    running_keep: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "_order", {p: i for i, p in enumerate(self.parameters)})

    def of(self, tensor: str) -> Parameter | None:
        """The parameter a tensor name (`weights/…`, `gradients/…`, `updates/…`, `biases/…`) is about, if any."""
        return self.parameters.get(path_of(tensor))

    def position(self, path: str) -> int:
        """Where a parameter comes in the model's order (-1 if it is not a parameter of the model)."""
        return self._order.get(path, -1)

    def layer_parameters(self, layer: str) -> list[Parameter]:
        """The parameters of one layer, in the model's order."""
        return [p for p in self.parameters.values() if p.layer == layer]

    def kernels(self, trainable: bool | None = True) -> list[Parameter]:
        """The kernels (dense, convolution, recurrent and attention weights), in the model's order."""
        return [p for p in self.parameters.values() if p.kernel and (trainable is None or p.trainable == trainable)]

    def statistics_settled(self, step: int, share: float = 0.01) -> bool:
        """Whether `step` training steps have left the running statistics less than `share` of their initial
        values (Keras' default momentum 0.99: 459 steps; torch's 0.1: 44), so that an evaluation reads the
        model, not the statistics it started with."""
        keep = self.running_keep
        return keep is None or keep <= 0 or keep ** step < share

    def to_dict(self) -> dict:
        return {"name": self.name, "parameters": [{**asdict(p), "shape": list(p.shape)}
                                                  for p in self.parameters.values()],
                "activations": dict(self.activations), "optimizers": list(self.optimizers),
                "inputs_scaled": self.inputs_scaled, "running_keep": self.running_keep}

    @classmethod
    def from_dict(cls, data) -> ModelInfo | None:
        """The structure from its stored form; None for anything that is not one (a run from before it, or a
        foreign file): rules then judge by collections alone."""
        if not isinstance(data, dict) or not isinstance(data.get("parameters"), list):
            return None
        fields = Parameter.__dataclass_fields__
        parameters = {}
        for entry in data["parameters"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                return None
            try:
                p = Parameter(**{k: v for k, v in entry.items() if k in fields})
            except TypeError:
                return None
            if p.role not in ROLES or p.layer_type not in LAYER_TYPES or not isinstance(p.shape, (list, tuple)):
                return None
            parameters[p.path] = Parameter(**{**asdict(p), "shape": tuple(p.shape)})
        activations = data.get("activations", {})
        if not isinstance(activations, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in activations.items()):
            activations = {}
        optimizers = data.get("optimizers", [])
        optimizers = tuple(o for o in optimizers if isinstance(o, str)) if isinstance(optimizers, list) else ()
        scaled = data.get("inputs_scaled", "")
        keep = data.get("running_keep")
        keep = float(keep) if isinstance(keep, (int, float)) and not isinstance(keep, bool) and 0 <= keep <= 1 \
            else None
        return cls(str(data.get("name", "")), parameters, activations, optimizers,
                   scaled if isinstance(scaled, str) else "", keep)


def role_of(model: ModelInfo | None, tensor: str) -> str:
    """The role of the parameter a tensor is about. Without a model structure, from its collection: a `biases/`
    tensor is a bias, any other parameter tensor a kernel (what every rule assumed before structures)."""
    parameter = model.of(tensor) if model is not None else None
    if parameter is not None:
        return parameter.role
    return "bias" if tensor.startswith("biases/") or is_bias(path_of(tensor)) else "kernel"


def parameter_collection(role: str, path: str) -> str:
    """`biases` for biases and normalisation shifts, `weights` for every other parameter (a parameter of an
    unknown role by its name), so that the collections mean the same in every framework."""
    if role in ("bias", "norm_shift"):
        return "biases"
    if role == "other":
        return "biases" if is_bias(path) else "weights"
    return "weights"
