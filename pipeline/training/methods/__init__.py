"""Every unlearning method, one module each: its token loss as a pure function, what it reads from the forward
pass, its hyper-parameters with their defaults and rules, and its own retain term. The loop that trains with them
is `pipeline.training.unlearn`.

A method's hyper-parameters are keys of the run config like any other (`unlearn.methods.npo.beta`, a run's
`beta:`): any layer may set them, a value is checked by the rules of the method that declares the key, and a run
reads only its own method's (`method_params`), so its record names only those.

To add a method, write its module beside these (a `METHOD = Method(...)`) and add it to `MODULES` below: the
registry is read from imports, so DVC's code deps (`tokenunlearn code-deps`) see the new file.
"""

from __future__ import annotations

from pipeline.common.params import check_rules, dataclass_from_params
from pipeline.training.methods import (altpo, ceu, ga, graddiff, idkdpo, idknll, npo, pdu, rmu, satimp, simnpo,
                                       undial, wga)
from pipeline.training.methods.base import ForwardOut, Method, NoParams, Prepared

MODULES = (ga, wga, npo, rmu, graddiff, simnpo, satimp, ceu, idkdpo, altpo, idknll, undial, pdu)
METHODS: dict[str, Method] = {module.METHOD.name: module.METHOD for module in MODULES}


def _declared(methods) -> dict[str, list[Method]]:
    """Every hyper-parameter key -> the methods that declare it, in registry order."""
    out: dict[str, list[Method]] = {}
    for method in methods:
        for key in method.hyperparameters:
            out.setdefault(key, []).append(method)
    return out


HYPERPARAMETERS = _declared(METHODS.values())

__all__ = ["METHODS", "HYPERPARAMETERS", "ForwardOut", "Method", "NoParams", "Prepared", "check_hyperparameters",
           "method_params"]


def method_params(method: str, values: dict):
    """Method METHOD's params: its keys of `values` (the hyper-parameters a run set), its defaults for the rest."""
    spec = METHODS[method]
    return spec.params(**{k: values[k] for k in spec.hyperparameters if k in values})


def check_hyperparameters(method: str, values: dict, where: str, origins: dict[str, str] | None = None) -> None:
    """Each hyper-parameter in `values`, by the type and rule of the method that declares it: the run's own method
    where it does (two methods may both have a `beta`), else the first that does. An error names the key where the
    value was set, e.g. `unlearn.methods.npo.beta=0: must be positive`."""
    for key, value in values.items():
        owner = METHODS[method] if key in METHODS[method].hyperparameters else HYPERPARAMETERS[key][0]
        one = dataclass_from_params(owner.params, {key: value}, where, origins)  # its type
        check_rules(one, {key: owner.rules[key]} if key in owner.rules else {}, where, origins)
