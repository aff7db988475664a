"""Where the kit test project's tasks land their effects."""


def effect(key: str) -> None:
    from tests.testapp.models import Effect

    Effect.objects.create(key=key)
