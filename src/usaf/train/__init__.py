"""The training job: run folder, data, the loop, checkpoints, evaluation, runtime.

`usaf.train(config, run_dir, resume=False, force=False)` is the job itself (`usaf.train.loop.train`): this package
is callable, so the public name and the package that holds the loop can be one name without one hiding the other
(a function bound as `usaf.train` would break `import usaf.train.loop as ...`)."""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, config, run_dir, resume: bool = False, force: bool = False) -> dict:
        return self.loop.train(config, run_dir, resume=resume, force=force)


sys.modules[__name__].__class__ = _CallablePackage
