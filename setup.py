"""Packaging glue: the repository's top level (shared/, services/, kernels/, lang/) is the product's layout;
installed, those folders live under one `radixflow` namespace so that generic names such as `kernels`
never collide with other distributions (transformers probes for a package named `kernels`)."""
from setuptools import find_packages, setup

TOPS = ("shared", "services", "kernels", "lang")
packages = [f"radixflow.{p}" for p in find_packages(include=[f"{t}" for t in TOPS] + [f"{t}.*" for t in TOPS])]
setup(
    packages=packages,
    package_dir={f"radixflow.{t}": t for t in TOPS},
    package_data={"radixflow.services": ["modelgen/assets/*.json"]},
    include_package_data=True,
)
