"""usage rows record the prefix index's predicted match beside the backend's reported cached tokens

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""
from alembic import op
import sqlalchemy as sa

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as b:
        b.add_column(sa.Column('predicted_cached_tokens', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as b:
        b.drop_column('predicted_cached_tokens')
