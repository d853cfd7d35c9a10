"""radixflow.lang: write LLM programs in Python, run them as radixflow programs.

    from radixflow.lang import function, gen, select, Runtime

SGLang's frontend vocabulary (`s += text`, `gen`, `select`, `s.fork(n)`, `forks.join()`,
`s["name"]`), sent to the server as one DAG when the control flow allows (function.py)."""
from .backend import Backend, NatsRuntime, ProgramError, Runtime, set_default_backend
from .function import Function, ProgramResult, function
from .ir import NeedsValue, gen, select

__all__ = ["Backend", "Function", "NatsRuntime", "NeedsValue", "ProgramError", "ProgramResult", "Runtime", "function",
           "gen", "select", "set_default_backend"]
