"""token and concurrency limits, budgets and prices

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""
from alembic import op
import sqlalchemy as sa

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'quotas',
        sa.Column('target', sa.String(400), primary_key=True),
        sa.Column('rpm', sa.BigInteger(), nullable=True),
        sa.Column('tpm', sa.BigInteger(), nullable=True),
        sa.Column('tpm_kind', sa.String(16), nullable=False),
        sa.Column('concurrency', sa.BigInteger(), nullable=True),
        sa.Column('budget_tokens', sa.BigInteger(), nullable=True),
        sa.Column('budget_usd', sa.Float(), nullable=True),
        sa.Column('budget_period', sa.String(8), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        'prices',
        sa.Column('model', sa.String(256), primary_key=True),
        sa.Column('input', sa.Float(), nullable=False),
        sa.Column('output', sa.Float(), nullable=False),
        sa.Column('cached', sa.Float(), nullable=True),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('prices')
    op.drop_table('quotas')
