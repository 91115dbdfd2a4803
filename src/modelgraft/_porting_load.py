"""placeholder"""
from typing import Any
def convert_and_load_state_dict_in_model(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
