from common.service import main
from services.tokenizer.server import TokenizerService

if __name__ == "__main__":
    main(TokenizerService, "tokenizer")
