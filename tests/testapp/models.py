"""Models the tests write effects to (no migrations: the test database is built from them)."""

from django.db import models


class Effect(models.Model):
    key = models.CharField(max_length=100, verbose_name="key", help_text="What the effect was for.")
    created_at = models.DateTimeField(auto_now_add=True, verbose_name="created at", help_text="When it landed.")

    def __str__(self) -> str:
        return self.key


class Order(models.Model):
    status = models.CharField(max_length=20, default="pending", verbose_name="status", help_text="Order state.")

    def __str__(self) -> str:
        return f"order {self.pk} ({self.status})"


class ChunkItem(models.Model):
    """One item of a chunked job, inserted by the run that processed it (no unique constraint: a repeat shows)."""

    job = models.CharField(max_length=100, verbose_name="job", help_text="The job the item belongs to.")
    item = models.IntegerField(verbose_name="item", help_text="The item's index in the job's sequence.")
    run = models.IntegerField(verbose_name="run", help_text="Which run of the job's body wrote it (1, 2, ...).")

    def __str__(self) -> str:
        return f"{self.job}[{self.item}] by run {self.run}"
