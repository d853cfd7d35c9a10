"""Rebuild the HELD-OUT corpus in schemas/ from pinned npm and PyPI packages.

    .venv/bin/python tests/structured/heldout/build.py [--cache /tmp/registry-corpus] [--out DIR] [--stats FILE]

Held out: measured once, at the end, and never used to tune radixflow. None of these packages is used
by `realworld/` or `fresh/`. Each source names its package, pinned version and the fixed rule that
picks its schemas; the fetching, bundling and checks are `../registry_corpus.py` (which reuses
`../realworld/build.py`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from registry_corpus import Source, main  # noqa: E402

HERE = Path(__file__).resolve().parent

APACHE_NOTE = ("package.json: {lic}; the package ships no license text. The standard Apache License 2.0 "
               "text follows.")
APACHE_TEXT = "ui5-manifest:LICENSE.txt"     # @ui5/manifest ships the unmodified Apache-2.0 text
COMMONJS = "lib-commonjs/schemas/*.schema.json"   # Rushstack ships each schema twice (lib-esm is identical)

SOURCES = [
    # ---- npm: Angular-style schematics and builders (option objects of code generators)
    Source("schematics-angular", "npm", "@schematics/angular", "21.2.30", "MIT", "Angular CLI schematics options",
           ["*/schema.json", "*/*/schema.json"], license_files=["LICENSE"]),
    Source("angular-cli", "npm", "@angular/cli", "21.2.30", "MIT", "angular.json workspace configuration; `ng update` options",
           ["lib/config/schema.json", "src/commands/update/schematic/schema.json"], license_files=["LICENSE"]),
    Source("angular-build", "npm", "@angular/build", "21.2.30", "MIT", "Angular builders options (application, dev-server, karma, unit-test, ...)",
           ["src/builders/*/schema.json"], base="src/builders", license_files=["LICENSE"]),
    Source("angular-material", "npm", "@angular/material", "22.2.7", "MIT", "Angular Material schematics options",
           ["schematics/**/schema.json"], base="schematics", license_files=["LICENSE"]),
    Source("angular-cdk", "npm", "@angular/cdk", "22.2.7", "MIT", "Angular CDK schematics options",
           ["schematics/**/schema.json"], base="schematics", license_files=["LICENSE"]),
    Source("angular-pwa", "npm", "@angular/pwa", "21.2.24", "MIT", "Angular PWA schematic options",
           ["**/schema.json"], license_files=["LICENSE"]),
    Source("angular-eslint", "npm", "@angular-eslint/schematics", "22.7.0", "MIT", "angular-eslint schematics options",
           ["dist/*/schema.json"], base="dist", license_files=["LICENSE"]),
    Source("ng-packagr", "npm", "ng-packagr", "21.2.7", "MIT", "ng-package.json and entry-point configuration",
           ["*.schema.json"], license_files=["LICENSE"]),
    Source("ngrx", "npm", "@ngrx/schematics", "22.0.1", "MIT", "NgRx schematics options",
           ["src/*/schema.json"], base="src", license_files=["LICENSE"]),   # src/modules/schematics/src/* are copies
    Source("nestjs", "npm", "@nestjs/schematics", "11.1.0", "MIT", "NestJS schematics options",
           ["dist/lib/**/schema.json"], base="dist/lib", license_files=["LICENSE"]),
    # ---- npm: Rushstack (Draft 4)
    Source("heft", "npm", "@rushstack/heft", "1.3.0", "MIT", "Heft build-system configuration and task options",
           [COMMONJS], base="lib-commonjs/schemas", license_files=["LICENSE"]),
    Source("heft-jest-plugin", "npm", "@rushstack/heft-jest-plugin", "2.0.17", "MIT", "Heft Jest plugin options",
           [COMMONJS], base="lib-commonjs/schemas", license_files=["LICENSE"]),
    Source("heft-lint-plugin", "npm", "@rushstack/heft-lint-plugin", "1.2.27", "MIT", "Heft lint plugin options",
           [COMMONJS], base="lib-commonjs/schemas", license_files=["LICENSE"]),
    Source("heft-typescript-plugin", "npm", "@rushstack/heft-typescript-plugin", "1.3.22", "MIT",
           "Heft TypeScript plugin options", [COMMONJS], base="lib-commonjs/schemas", license_files=["LICENSE"]),
    Source("rig-package", "npm", "@rushstack/rig-package", "0.7.4", "MIT", "rig.json",
           [COMMONJS], base="lib-commonjs/schemas", license_files=["LICENSE"]),
    Source("api-extractor", "npm", "@microsoft/api-extractor", "7.60.2", "MIT", "api-extractor.json",
           [COMMONJS], base="lib-commonjs/schemas", license_files=["LICENSE"]),
    Source("api-documenter", "npm", "@microsoft/api-documenter", "7.30.18", "MIT",
           "api-documenter.json; DocFX TypeScript YAML page", [COMMONJS, "lib-commonjs/yaml/*.schema.json"],
           base="lib-commonjs", license_files=["LICENSE"]),
    # ---- npm: other tool configurations and data formats
    Source("ui5-project", "npm", "@ui5/project", "4.0.17", "Apache-2.0", "UI5 Tooling ui5.yaml / ui5-workspace.yaml (by kind)",
           ["lib/validation/schema/**/*.json"], base="lib/validation/schema", license_files=["LICENSE.txt"]),
    Source("ui5-manifest", "npm", "@ui5/manifest", "1.89.0", "Apache-2.0", "SAPUI5 app descriptor manifest.json (large)",
           ["schema.json"], license_files=["LICENSE.txt"]),
    Source("vega-lite", "npm", "vega-lite", "6.4.3", "BSD-3-Clause", "Vega-Lite visualization specification (very large)",
           ["build/vega-lite-schema.json"], base="build", license_files=["LICENSE"]),
    Source("vega", "npm", "vega", "6.4.0", "BSD-3-Clause", "Vega visualization specification (large)",
           ["build/vega-schema.json"], base="build", license_files=["LICENSE"]),
    Source("wrangler", "npm", "wrangler", "4.86.0", "MIT OR Apache-2.0 (Apache-2.0 chosen)",
           "Cloudflare Workers wrangler.json", ["config-schema.json"],
           license_missing=(APACHE_NOTE.format(lic="MIT OR Apache-2.0"), APACHE_TEXT)),
    Source("firebase-tools", "npm", "firebase-tools", "15.37.0", "MIT",
           "firebase.json, .firebaserc, extension.yaml, Data Connect and App Testing YAML",
           ["schema/*.json"], base="schema", license_files=["LICENSE"]),
    Source("knip", "npm", "knip", "6.48.0", "ISC", "knip configuration (and its JSONC wrapper)",
           ["schema*.json"], license_files=["LICENSE"]),
    Source("custom-elements-manifest", "npm", "custom-elements-manifest", "2.1.0", "BSD-3-Clause",
           "Custom Elements Manifest (web components description)", ["schema.json"], license_files=["LICENSE"]),
    Source("openapi-generator-cli", "npm", "@openapitools/openapi-generator-cli", "2.35.0", "Apache-2.0",
           "openapitools.json generator configuration", ["config.schema.json"],
           license_missing=(APACHE_NOTE.format(lic="Apache-2.0"), APACHE_TEXT)),
    Source("oxlint", "npm", "oxlint", "1.96.0", "MIT", "oxlint configuration (large)",
           ["configuration_schema.json"], license_files=["LICENSE"]),
    Source("eas-cli", "npm", "eas-cli", "24.8.0", "MIT", "EAS app-store metadata (store.config.json)",
           ["schema/*.json"], base="schema", license_files=["LICENSE"]),
    Source("adobe-reactor", "npm", "@adobe/reactor-turbine-schemas", "10.9.0", "Apache-2.0",
           "Adobe Experience Platform Tags container and extension package manifests",
           ["schemas/*.json"], base="schemas", license_files=["LICENSE"]),
    Source("alexa-ask", "npm", "@alexa/ask-expressions-spec", "0.0.2", "Apache-2.0",
           "Alexa Conversations ASK expressions (intermediate representation nodes)",
           ["schemas/*.json"], base="schemas", license_missing=(APACHE_NOTE.format(lic="Apache-2.0"), APACHE_TEXT)),
    # ---- PyPI
    Source("stix2", "pypi", "stix2-validator", "3.3.2", "BSD-3-Clause",
           "STIX 2.1 threat-intelligence objects: every SDO, SRO and cyber observable",
           ["stix2validator/schemas-2.1/schemas/sdos/*.json", "stix2validator/schemas-2.1/schemas/sros/*.json",
            "stix2validator/schemas-2.1/schemas/observables/*.json"],
           extra=["stix2validator/schemas-2.1/schemas/common/*.json"], base="stix2validator/schemas-2.1/schemas",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("datapackage", "pypi", "datapackage", "1.15.4", "MIT",
           "Frictionless Data Package profiles (data/tabular/fiscal package and resource)",
           ["datapackage/profiles/*.json"], exclude=["datapackage/profiles/registry.json"],
           base="datapackage/profiles", license_files=["*.dist-info/LICENSE.md"]),
    Source("tableschema", "pypi", "tableschema", "1.21.0", "MIT", "Frictionless Table Schema",
           ["tableschema/profiles/table-schema.json"], base="tableschema/profiles",
           license_files=["*.dist-info/LICENSE.md"]),   # (its geojson.json is the document realworld/ has)
    Source("linkml", "pypi", "linkml-runtime", "1.12.1", "CC0-1.0", "LinkML metamodel and its modules (meta is large)",
           ["linkml_runtime/linkml_model/jsonschema/*.schema.json"], base="linkml_runtime/linkml_model/jsonschema",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("bids", "pypi", "bidsschematools", "2.0.1", "MIT", "BIDS schema metaschema",
           ["bidsschematools/data/metaschema.json"], base="bidsschematools/data",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("dandischema", "pypi", "dandischema", "0.14.0", "Apache-2.0", "DataCite / InvenioRDM metadata (4 revisions)",
           ["dandischema/datacite/schema/*.json"], base="dandischema/datacite/schema",
           license_files=["*.dist-info/licenses/LICENSE"]),
    Source("airbyte", "pypi", "airbyte-cdk", "7.39.1", "MIT",
           "Airbyte low-code connector manifest (large; shipped as YAML)",
           ["airbyte_cdk/sources/declarative/declarative_component_schema.yaml"],
           base="airbyte_cdk/sources/declarative", license_files=["*.dist-info/LICENSE.txt"]),
]

if __name__ == "__main__":
    sys.exit(main(SOURCES, HERE))
