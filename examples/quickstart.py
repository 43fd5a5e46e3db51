"""Quick start: wrap a handler, deliver a message twice, see it applied once."""

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome, install

engine = create_engine("sqlite://")  # or "postgresql+psycopg://user@host/db"
install(engine)  # creates processed_events and outbox if missing
with engine.begin() as conn:
    conn.execute(text("CREATE TABLE accounts (id VARCHAR(64) PRIMARY KEY, balance INTEGER)"))
    conn.execute(text("INSERT INTO accounts VALUES ('alice', 0)"))

dedup = Deduplicator(engine, consumer="ledger")


@dedup.handler
def credit(message: Message, session: Session) -> None:
    payment = message.json()
    session.execute(
        text("UPDATE accounts SET balance = balance + :amount WHERE id = :account"), payment
    )


payment = Message(id="pay-1", body=b'{"account": "alice", "amount": 25}')
assert credit(payment) is Outcome.PROCESSED
assert credit(payment) is Outcome.DUPLICATE  # a redelivery: the handler is not called

with engine.connect() as conn:
    balance = conn.execute(text("SELECT balance FROM accounts WHERE id = 'alice'")).scalar()
print(f"alice's balance: {balance}")  # 25, not 50
