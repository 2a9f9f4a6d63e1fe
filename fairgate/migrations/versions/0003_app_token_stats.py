"""FairServe: the snapshot of per-(app, stage) token statistics

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""
from alembic import op
import sqlalchemy as sa

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('app_token_stats',
    sa.Column('app', sa.String(length=128), nullable=False),
    sa.Column('stage', sa.Integer(), nullable=False),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.Column('mean_input', sa.Float(), nullable=False),
    sa.Column('mean_system', sa.Float(), nullable=False),
    sa.Column('mean_output', sa.Float(), nullable=False),
    sa.Column('landmark', sa.Float(), nullable=False),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('app', 'stage')
    )


def downgrade() -> None:
    op.drop_table('app_token_stats')
