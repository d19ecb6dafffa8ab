from fk_runtime.harness.pytest_plugin import *  # noqa: F403  (device setup before kernels are defined)
