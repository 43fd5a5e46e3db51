"""A service in one module: ``consumerdedup run app_quickstart:app`` runs it.

    export CONSUMERDEDUP_DATABASE_URL=postgresql://app@127.0.0.1/app
    export CONSUMERDEDUP_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:5672/%2F
    consumerdedup init-db
    consumerdedup run app_quickstart:app

``python app_quickstart.py`` runs the same app with no server: SQLite and the in-memory
broker, as your own tests can (docs/testing.md).
"""

from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import App


class Payment(BaseModel):
    account: str
    amount: int


app = App("payments")


@app.rabbitmq(queue="payments", consumer="ledger", batch_size=50)
def credit(payment: Payment, session: Session) -> None:
    session.execute(
        text("UPDATE accounts SET balance = balance + :amount WHERE id = :account"),
        payment.model_dump(),
    )


if __name__ == "__main__":
    import tempfile

    from sqlalchemy import create_engine

    from consumerdedup import install
    from consumerdedup.app import Settings
    from consumerdedup.headers import REASON_HEADER
    from consumerdedup.testing import MemoryBroker

    url = f"sqlite:///{tempfile.mkdtemp()}/payments.db"
    engine = create_engine(url)
    install(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER)"))
        conn.execute(text("INSERT INTO accounts VALUES ('alice', 0)"))

    broker = MemoryBroker()
    for _ in range(2):  # one payment, delivered twice
        broker.publish("payments", b'{"account": "alice", "amount": 25}', message_id="pay-1")
    broker.publish("payments", b'{"account": "alice"}', message_id="pay-2")  # no amount
    app.run(settings=Settings.load(database_url=url), memory_broker=broker, until_idle=True)

    with engine.connect() as conn:
        balance = conn.execute(text("SELECT balance FROM accounts WHERE id = 'alice'")).scalar()
    [refused] = broker.messages("payments.dlq")
    print(f"alice's balance: {balance}")  # 25, not 50
    print(f"dead-lettered: {refused.id} ({refused.headers[REASON_HEADER]})")
