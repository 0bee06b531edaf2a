"""The modules that register JVP and batching rules, loaded in one place.

A rule exists only once its module has run, and nothing else imports these modules: the transforms read the tables
of fulmen.ops.rules.tables and the rule files import only the rule API. fulmen/__init__.py imports this module, and
every entry point (`import fulmen`, `import fulmen.functional.forward_mode`, any `fulmen.<module>`) runs
fulmen/__init__.py first, so the tables are full before any transform runs. Not fulmen/ops/__init__.py: these files
import transforms.vjp_prims (the elementwise derivatives the JVP rules share with the grad rules), which imports
the ops families, so loading them from ops would be a cycle; not fulmen/transforms/__init__.py, which importing
any transform would then make heavy. A rule module that moves into its op's family (ops/<family>.py) leaves this
list: ops/__init__.py loads the families.
"""

from fulmen.transforms import (  # noqa: F401  (registration side effects)
    batching_prims,
    batching_random,
    batching_torch,
    jvp_rules,
)
