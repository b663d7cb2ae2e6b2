"""Where lagscope's settings come from, by name: the variables' prefix and separator, and
the variable naming a config file.

Apart from `producers/config.py` (which imports pydantic-settings, ~0.1 s) so that a
command that loads the configuration model only when some setting is given, `lagscope
analyze`, can tell whether one is, at no cost.

>>> processor_settings_given({"LAGSCOPE_PROCESSOR__EPISODES__MIN_COST": "0.1"})
True
>>> processor_settings_given({"LAGSCOPE_KAFKA__BOOTSTRAP_SERVERS": "kafka:9092"})
False
"""

from __future__ import annotations

from collections.abc import Mapping

ENV_PREFIX = "LAGSCOPE_"
#: Separates a section from its field in variable and secret-file names.
NESTED_DELIMITER = "__"
CONFIG_ENV = f"{ENV_PREFIX}CONFIG"
SECRETS_DIR_ENV = f"{ENV_PREFIX}SECRETS_DIR"


def processor_settings_given(env: Mapping[str, str]) -> bool:
    """Whether `env` names a config file or sets a `processor` setting (variables are read
    without regard to case, as the configuration model reads them)."""
    section = f"{ENV_PREFIX}PROCESSOR{NESTED_DELIMITER}"
    return any(name.upper() == CONFIG_ENV or name.upper().startswith(section) for name in env)
