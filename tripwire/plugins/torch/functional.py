"""ReLUs a model applies as functions (`F.relu(self.fc1(x))`, `torch.relu`, `x.relu()`), which no module hook
sees: found in the autograd graph of a sampled training step's forward pass.

A ReLU counts where its input is a layer's output, as the layer made it or through what keeps each of its units
(a max pool, dropout, a reshape). It is captured as the ReLU of that layer's output, `activations/fc1:relu`: a
unit it never passes is one the layer never makes positive. A ReLU on anything else (a residual sum, a loss's
margin) has no layer whose units it switches off, and is left out; an activation module's output is its hook's.

The graph is walked at the first sampled step only, to learn which layers' outputs a ReLU takes (a model computes
alike at every step). No tensor autograd saved is read (unpacking one runs saved-tensor hooks: activation
checkpointing would recompute its segment); the layers' outputs are held as their forward hooks saw them, within a
budget, until the walk. From then on only those layers are hooked, and each output is taken as the layer makes
it: nothing is held and no graph walked; a model without such a ReLU costs nothing more.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .relations import batch_tensors
from .structure import has_parameters, is_activation, named_modules

SUFFIX = ":relu"
_RELU = "ReluBackward0"
# autograd nodes that keep each unit of their input apart: a ReLU after them switches off the layer's units below
_KEEPS_UNITS = ("MaxPool1DWithIndicesBackward0", "MaxPool2DWithIndicesBackward0", "MaxPool3DWithIndicesBackward0",
                "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "NativeDropoutBackward0")
_LOOKED_THROUGH = 3  # such nodes between a layer's output and its ReLU, at most
_HELD_BYTES = 64 * 2 ** 20  # layers' outputs held for the walk; past this, held only while the model holds them


class FunctionalReLUs:
    """take(layer path, layer, output): called with the output of each layer a ReLU takes, in the order the forward
    runs them. `watch` makes a sampled step's hooks; `walk` looks at the graph behind a result of its forward pass
    (before the backward pass); `release` ends the step."""

    def __init__(self, module: torch.nn.Module, take):
        modules = list(named_modules(module))
        self._layers = [(path, m) for path, m in modules if path and has_parameters(m)]
        self._activations = [m for _, m in modules if is_activation(m)]
        self._take = take
        self._feeding: dict | None = None  # layer path -> layer, for the layers a ReLU takes; None until learned
        self._found: dict = {}  # the same, as the walks of the learning step find them
        self._walked = False  # a walk ran in this step
        self.release()

    def watch(self) -> list:
        """Forward hooks for this sampled step (the caller removes them)."""
        if self._feeding is not None:
            return [m.register_forward_hook(functools.partial(self._layer_fed, path))
                    for path, m in self._feeding.items()]
        return [m.register_forward_hook(functools.partial(self._layer_output, path)) for path, m in self._layers] + \
            [m.register_forward_hook(self._activation_output) for m in self._activations]

    def release(self) -> None:
        """The step ended: what its walks found is learned; what it held is let go."""
        if self._walked:
            self._feeding = dict(self._found)
        self._outputs: dict = {}  # grad_fn of a layer's output -> (its path, the layer, the output, its version)
        self._held = 0  # bytes of the outputs held
        self._own: set = set()  # grad_fn of each activation module's output
        self._visited: set = set()  # the graph's nodes walked in this step
        self._walked = False

    def _layer_fed(self, path: str, module, inputs, output) -> None:
        if isinstance(output, torch.Tensor) and module.training and torch.is_grad_enabled():
            self._take(path, module, output)

    def _layer_output(self, path: str, module, inputs, output) -> None:
        if not isinstance(output, torch.Tensor) or output.grad_fn is None:
            return
        try:  # a forward hook: a tensor that cannot say its size (nested, a subclass) is not followed
            size = output.numel() * output.element_size()
        except (RuntimeError, NotImplementedError):
            return
        held = output if self._held + size <= _HELD_BYTES else weakref.ref(output)
        self._held += size if held is output else 0
        self._outputs[output.grad_fn] = (path, module, held, output._version)

    def _activation_output(self, module, inputs, output) -> None:
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            self._own.add(output.grad_fn)

    def walk(self, result) -> None:
        """While learning: the ReLUs on a layer's output in the graph behind `result` (a tensor, or tuples, lists
        and mappings of them) not walked before in this step, each layer's output taken where it is still held."""
        if self._feeding is not None:
            return
        self._walked = True
        stack = [t.grad_fn for t in batch_tensors(result) if t.grad_fn is not None]
        relus = []
        while stack:
            node = stack.pop()
            if node is None or node in self._visited:
                continue
            self._visited.add(node)
            if node.name() == _RELU and node not in self._own:
                relus.append(node)
            stack.extend(below for below, _ in node.next_functions)
        for relu in sorted(relus, key=lambda node: node._sequence_nr()):
            made = self._layer_below(relu)
            if made is None:
                continue
            path, module, held, version = made
            self._found[path] = module
            output = held() if isinstance(held, weakref.ref) else held
            if output is not None and (output._version == version or output.grad_fn is relu):  # as made, or as
                self._take(path, module, output)  # this ReLU changed it in place

    def _layer_below(self, relu):
        """What the layer whose output the ReLU takes left (`_outputs`), where it is one."""
        node = relu.next_functions[0][0] if relu.next_functions else None
        for _ in range(_LOOKED_THROUGH + 1):
            if node is None:
                return None
            made = self._outputs.get(node)
            if made is not None:
                return made
            if node.name() not in _KEEPS_UNITS or not node.next_functions:
                return None
            node = node.next_functions[0][0]
        return None
