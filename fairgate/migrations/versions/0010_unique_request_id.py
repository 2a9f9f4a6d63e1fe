"""a usage row's request_id is unique: a row written again (a batch replayed after its commit was lost, a
journal drained twice) is stored once

A database written before may hold rows with the same request_id (a spool replayed twice). None is deleted:
each later copy keeps its row, its request_id suffixed with ``~dup`` and its row id, so the index can be made
unique and every row stays in the audit as it was.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28
"""
from alembic import op
import sqlalchemy as sa

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    usage = sa.table('usage_log', sa.column('id', sa.Integer), sa.column('request_id', sa.String(128)))
    later, earlier = usage.alias('later'), usage.alias('earlier')
    earliest = (sa.select(sa.func.min(earlier.c.id)).where(earlier.c.request_id == later.c.request_id)
                .correlate(later).scalar_subquery())
    copies = sa.select(later.c.id).where(later.c.id > earliest)  # every row but the first of its request_id
    op.execute(usage.update().where(usage.c.id.in_(copies))
               .values(request_id=sa.func.substr(usage.c.request_id, 1, 100).concat('~dup')
                       .concat(sa.cast(usage.c.id, sa.String))))
    with op.batch_alter_table('usage_log', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_log_request_id'))
        batch_op.create_index(batch_op.f('ix_usage_log_request_id'), ['request_id'], unique=True)


def downgrade() -> None:
    with op.batch_alter_table('usage_log', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_log_request_id'))
        batch_op.create_index(batch_op.f('ix_usage_log_request_id'), ['request_id'], unique=False)
