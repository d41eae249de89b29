"""Unsplit NumPy layers with explicit forward and backward: the reference the parallel layers
are checked against, and the pieces pipeline stages are made of.

Every layer (here, in tensor.py and the pipeline stages) follows one small protocol:

    y, cache = layer.forward(x)                    # x: (rows, in_features)
    dx, grads = layer.backward(dy, cache)          # grads: {param name: gradient}
    dx, grads = layer.backward(dy, cache, input_grad=False)    # dx is None: not computed
    layer.params                                   # {param name: array}, updated in place

The cache is returned, not stored, so any number of micro-batches can be in flight at once
(a pipeline stage keeps one cache per micro-batch). Parameter names are given by the caller
(Linear(w, b, names=("W0", "b0"))), so a model's layers can be handed to ringcoll.optim and
DistributedOptimizer as one dict, and compared name by name with an unsplit run.
"""

import numpy as np

from ..errors import InvalidArgumentError

_GELU_C = np.sqrt(2.0 / np.pi)


def _relu(z):
    return np.maximum(z, 0)


def _relu_grad(z, dy):
    return dy * (z > 0)


def _gelu(z):
    """GELU, tanh approximation (as GPT-2 and Megatron-LM)."""
    return 0.5 * z * (1 + np.tanh(_GELU_C * (z + 0.044715 * z ** 3)))


def _gelu_grad(z, dy):
    t = np.tanh(_GELU_C * (z + 0.044715 * z ** 3))
    return dy * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * z * z))


ACTIVATIONS = {"relu": (_relu, _relu_grad), "gelu": (_gelu, _gelu_grad)}


def activation(name, where="ringcoll"):
    """(function, gradient) of an activation by name: 'relu' or 'gelu'."""
    if name not in ACTIVATIONS:
        raise InvalidArgumentError(f"{where}: unknown activation {name!r}; choose one of "
                                   f"{sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class Linear:
    """y = x @ weight + bias, weight of shape (in_features, out_features).

    Args:
        weight: (in_features, out_features) array, used (and updated) in place.
        bias: (out_features,) array or None.
        names: the two parameter names (default ("weight", "bias")).
    """

    def __init__(self, weight, bias=None, names=("weight", "bias")):
        if np.ndim(weight) != 2 or (bias is not None and np.shape(bias) != weight.shape[1:]):
            raise InvalidArgumentError(
                f"ringcoll Linear: weight must be 2-D (in, out) and bias of shape (out,); got "
                f"{np.shape(weight)} and {None if bias is None else np.shape(bias)}")
        self.weight, self.bias = weight, bias
        self.names = tuple(names)
        self.params = {names[0]: weight} if bias is None else {names[0]: weight, names[1]: bias}
        self.in_features, self.out_features = weight.shape
        self.dtype = weight.dtype

    def forward(self, x):
        y = x @ self.weight
        if self.bias is not None:
            y += self.bias
        return y, x

    def backward(self, dy, x, input_grad=True):
        grads = {self.names[0]: x.T @ dy}
        if self.bias is not None:
            grads[self.names[1]] = dy.sum(axis=0)
        return (dy @ self.weight.T if input_grad else None), grads

    def shards(self):
        """Which parameters are blocks of bigger tensors (for checkpoints): none, here."""
        return {}


class Activation:
    """An elementwise activation ('relu' or 'gelu'); no parameters."""

    def __init__(self, name="relu"):
        self.name = name
        self.fn, self.grad = activation(name, "ringcoll Activation")
        self.params = {}
        self.in_features = self.out_features = self.dtype = None  # whatever comes in

    def forward(self, x):
        return self.fn(x), x

    def backward(self, dy, z, input_grad=True):
        return (self.grad(z, dy) if input_grad else None), {}

    def shards(self):
        return {}


class Sequential:
    """Layers applied in order; params and grads are the union of the layers' (names must
    not repeat). in_features / out_features / dtype come from the first / last layer that
    has them."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.params = {}
        for layer in self.layers:
            clash = set(layer.params) & set(self.params)
            if clash:
                raise InvalidArgumentError(f"ringcoll Sequential: parameter name(s) "
                                           f"{sorted(clash)} used by two layers")
            self.params.update(layer.params)
        sized = [layer for layer in self.layers if layer.in_features is not None]
        self.in_features = sized[0].in_features if sized else None
        self.out_features = sized[-1].out_features if sized else None
        self.dtype = sized[0].dtype if sized else None

    def forward(self, x):
        caches = []
        for layer in self.layers:
            x, cache = layer.forward(x)
            caches.append(cache)
        return x, caches

    def backward(self, dy, caches, input_grad=True):
        grads = {}
        for i in reversed(range(len(self.layers))):
            dy, g = self.layers[i].backward(dy, caches[i], input_grad=input_grad or i > 0)
            grads.update(g)
        return dy, grads

    def shards(self):
        """{name: ringcoll.checkpoint.Shard} of every layer's split parameters: what
        save_checkpoint / load_checkpoint need to place this rank's blocks."""
        out = {}
        for layer in self.layers:
            out.update(layer.shards() if hasattr(layer, "shards") else {})
        return out


def mlp(params, activation_name="relu", first=0, last=None):
    """Layers first..last-1 of the MLP in params ({"W0", "b0", "W1", ...}, the digits example's
    naming) as a Sequential: each Linear followed by the activation, except the model's last
    layer. Views, not copies: updating the Sequential's params updates `params`."""
    layers = len([k for k in params if k.startswith("W")])
    out = []
    for i in range(first, layers if last is None else last):
        out.append(Linear(params[f"W{i}"], params[f"b{i}"], names=(f"W{i}", f"b{i}")))
        if i < layers - 1:
            out.append(Activation(activation_name))
    return Sequential(out)
