"""Alembic environment, used only programmatically (verifier.db.upgrade passes the connection).

`alembic` on the command line works too: `alembic -x url=sqlite:///verifier.db upgrade head`
with `script_location` pointing here, for operators who want to migrate by hand.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from neuroshard.verifier.db import normalise_url
from neuroshard.verifier.models import Base

target_metadata = Base.metadata


def run_with(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        run_with(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("pass the database as: alembic -x url=postgresql://... upgrade head")
    engine = create_engine(normalise_url(url))
    with engine.begin() as conn:
        run_with(conn)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run against a database")
run()
