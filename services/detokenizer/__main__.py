from common.service import main
from services.detokenizer.server import DetokenizerService

if __name__ == "__main__":
    main(DetokenizerService, "detokenizer")
