"""Samples carry their images: `samples.images` (jsonb, NULL for a sample without any).

From this version on, the proxy records the images of chat messages once per session
(`image_recorded` events, referenced by hash from the request bodies), and the projection lists
each sample's images with their placeholder span in its tokens (`store.samples`). Rows projected
before have NULL, as a text-only sample has: a rebuild (`trajstore project --rebuild`) fills it for
sessions recorded with images.

Revision ID: 0014_sample_images
Revises: 0013_partitioned_events
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014_sample_images"
down_revision: str | None = "0013_partitioned_events"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE samples ADD COLUMN images jsonb")


def downgrade() -> None:
    op.execute("ALTER TABLE samples DROP COLUMN images")
