"""IPython.display's two names that sglang/utils.py imports (notebook output, unused by a server)."""


class HTML:
    def __init__(self, data=None, *args, **kwargs):
        self.data = data


def display(*objs, **kwargs) -> None:
    for obj in objs:
        print(getattr(obj, "data", obj))
